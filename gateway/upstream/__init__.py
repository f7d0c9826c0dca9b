"""The gateway's side of an engine: the HTTP/1.1 client and its connection pool (`client`), an
answer's body passed on as it arrives (`stream`), and a stream written straight to the client's
socket under gunicorn's gevent worker (`relay`)."""
