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


def replica(replica_id: str) -> str:
    """Hash: one field per ReplicaRecord attribute, JSON-encoded."""
    return f"{PREFIX}:replica:{replica_id}"


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
