"""The Redis key schema: every key llmgw reads or writes is named here, nowhere else.

Values are JSON unless said otherwise. Replica records are hashes whose field values are JSON, so the
control plane and the node agent can each write their own fields without a read-modify-write race.
"""

from __future__ import annotations

PREFIX = "llmgw"

# --- catalog -------------------------------------------------------------------------------------
# JSON {"version", "hash", "spec", "applied_at", "applied_by", "source"}; replaced atomically.
CATALOG = f"{PREFIX}:catalog"
# List of JSON {"version", "hash", "applied_at", "applied_by", "source", "spec"}, newest first.
CATALOG_HISTORY = f"{PREFIX}:catalog:history"
# Serialises applies from the file watcher (LLMGW_CATALOG) so two control workers don't race.
CATALOG_FILE_LOCK = f"{PREFIX}:lock:catalog-file"
# Hash: what the LLMGW_CATALOG watcher last saw of its file {path, stamp, sha, version, problems}, so
# an unchanged file costs one stat and one HGETALL, and a rejected change is logged once, not per pass.
CATALOG_FILE_STATE = f"{PREFIX}:catalog:file"

# --- nodes ---------------------------------------------------------------------------------------
# Set of every node name that ever sent a heartbeat (so an expired one can be reported as Lost).
NODES = f"{PREFIX}:nodes"
# Hash: node name -> when housekeeping first saw it without a heartbeat (it forgets such a node, once
# nothing refers to it, some minutes later; the entry goes when the node heartbeats again).
NODES_MISSING_SINCE = f"{PREFIX}:nodes:missing-since"
# Hash: node name -> heartbeat_at of its last heartbeat (kept after the heartbeat expires), so the
# control plane knows how long a Lost node has been gone.
NODES_LAST_SEEN = f"{PREFIX}:nodes:last-seen"


def node_heartbeat(name: str) -> str:
    """JSON NodeInfo, written with EX ttl by the node's agent. Absent means the node is not live."""
    return f"{PREFIX}:node:{name}:heartbeat"


def node_admin(name: str) -> str:
    """Hash of operator intent for a node: cordoned, draining (values "1"/"0"). No TTL."""
    return f"{PREFIX}:node:{name}:admin"


def agent_wake(name: str) -> str:
    """List the launch/stop tasks push replica ids onto so the agent loop reacts at once."""
    return f"{PREFIX}:node:{name}:wake"


# --- replicas ------------------------------------------------------------------------------------
REPLICAS = f"{PREFIX}:replicas"  # set of replica ids
# String "1": every replica record is in the per-node index (`node_replicas`), so a node without an
# index set has no replicas. Set by the control plane's housekeeping after it rebuilt the index; until
# then `Store.replicas_on` falls back to a scan of every record (records written before the index).
REPLICA_NODE_INDEX_READY = f"{PREFIX}:replicas:node-index"


def node_replicas(name: str) -> str:
    """Set of the ids of the replica records that name this node (head or member), kept in the same
    MULTI as the record's creation, deletion and node assignment."""
    return f"{PREFIX}:node:{name}:replicas"


def replica(replica_id: str) -> str:
    """Hash: one field per ReplicaRecord attribute, JSON-encoded."""
    return f"{PREFIX}:replica:{replica_id}"


# Field of a replica's hash (not a key of its own): `stopped_on:<node>` = when the agent of that node
# confirmed its part of the replica gone after a stop request. One field per node, so the agents of a
# multi-node replica confirm concurrently without a read-modify-write race, and the fields go with the
# record (Store.delete_replica). Loaded into ReplicaRecord.stopped_nodes.
REPLICA_STOPPED_ON_PREFIX = "stopped_on:"


def replica_stopped_on(node: str) -> str:
    """The replica-hash field in which `node`'s agent confirms its part stopped."""
    return REPLICA_STOPPED_ON_PREFIX + node


def load(replica_id: str) -> str:
    """JSON LoadRecord written by the agent after each scrape, with a TTL."""
    return f"{PREFIX}:load:{replica_id}"


# --- endpoints -----------------------------------------------------------------------------------
# JSON {"version", "fingerprint", "published_at", "endpoints": [EndpointInfo...]}
ENDPOINTS = f"{PREFIX}:endpoints"
# Integer, INCR'd in the same MULTI as ENDPOINTS: what readers poll.
ENDPOINTS_VERSION = f"{PREFIX}:endpoints:version"
# Pub/sub channel: a hint that ENDPOINTS changed (at-most-once; readers also poll the version).
ENDPOINTS_CHANNEL = f"{PREFIX}:endpoints:changed"

# --- Celery queues (the broker is this Redis: each queue is a list of that name) ------------------
# The control plane's tasks (reconcile, publish, housekeeping), consumed by the control workers.
CONTROL_QUEUE = "control"
NODE_QUEUE_PREFIX = "node-"


def node_queue(node: str) -> str:
    """The queue of `node`'s agent (`celery -A workers worker -Q node-<name>`): launch and stop tasks
    for the replicas placed there. The one spelling, for the control plane, the agent, `llmgw up`."""
    return NODE_QUEUE_PREFIX + node


# --- locks ---------------------------------------------------------------------------------------
RECONCILE_LOCK = f"{PREFIX}:lock:reconcile"
PUBLISH_LOCK = f"{PREFIX}:lock:publish"

# --- gateway: API keys, rate limits, usage ---------------------------------------------------------
API_KEYS = f"{PREFIX}:apikeys"  # hash: key id -> JSON {name, hash, rpm, tpm, priority, created_at}


def api_key_by_hash(key_hash: str) -> str:
    return f"{PREFIX}:apikey:{key_hash}"  # string: key id


def rate_window(key_id: str, kind: str, minute: int) -> str:
    return f"{PREFIX}:rl:{key_id}:{kind}:{minute}"


def usage(key_id: str) -> str:
    return f"{PREFIX}:usage:{key_id}"  # hash: "<model>:prompt" / "<model>:completion" / "<model>:requests"
