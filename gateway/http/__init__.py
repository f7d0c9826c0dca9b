"""The gateway's HTTP surface: the WSGI entry (`wsgi`), the proxied request (`proxy`), the answers it
writes (`answer`), how a refusal is worded (`refusal`), and the Flask views (`views`)."""
