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

# --- gateways ------------------------------------------------------------------------------------
# Set of the ids of gateway processes that ever reported (expired ones are tidied by readers).
GATEWAYS = f"{PREFIX}:gateways"


def gateway_report(gateway_id: str) -> str:
    """JSON GatewayReport of one gateway process, written with a TTL several times a second."""
    return f"{PREFIX}:gateway:{gateway_id}"


# What the gateways sent where (gateway.server.sendshare). A hash of the gateways that share their
# sends: origin (a gunicorn master's host:pid) -> wall clock of its last flush ...
SENDS_ORIGINS = f"{PREFIX}:sends:origins"


def sends(origin: str) -> str:
    """... and a stream per origin: one entry per flush of one of its workers, {"d": JSON [[endpoint,
    sent_at, prefill_s, base64 block keys], ...]}, trimmed by age (MINID) as it is written and expiring
    with its gateway. Every gateway reads the others' into its prefix index."""
    return f"{PREFIX}:sends:{origin}"


# Eviction across gateways (gateway.routing.remote_eviction). A hash per model: asker (a gateway
# worker, "<origin>/<pid>") -> JSON ask of the request that ranks first in its queue, refreshed at each
# of its looks and expiring when nobody asks ...
def evict_asks(model: str) -> str:
    return f"{PREFIX}:evict:asks:{model}"


def evict_claim(asker: str, model: str, seq: int) -> str:
    """... and one key per ask answered, set once (NX) by the worker that evicts for it: the victim's
    endpoint id. Expires on its own."""
    return f"{PREFIX}:evict:claim:{asker}:{model}:{seq}"


# --- autoscaling (docs/autoscaling.md) --------------------------------------------------------------
# Hash: "<model>/<profile>" -> JSON ScaleState, the autoscaler's wanted count and why (profile names
# have no "/", so the last one splits the field). Written by the reconcile pass; read by `llmgw status`.
AUTOSCALE = f"{PREFIX}:autoscale"


def autoscale_field(model: str, profile: str) -> str:
    return f"{model}/{profile}"


def autoscale_history(model: str, profile: str) -> str:
    """Sorted set of JSON samples scored by time, trimmed by age and count every pass."""
    return f"{PREFIX}:autoscale:history:{model}/{profile}"


def demand_hint(model: str) -> str:
    """JSON DemandHint, written with a short TTL by a gateway that holds requests for a model with no
    Ready replica (a cold start)."""
    return f"{PREFIX}:demand:{model}"


# --- LoRA adapters (docs/catalog.md#adapters-lora) ------------------------------------------------------
# JSON {"at", "rows": [{"adapter", "model", "wanted", "placed", "reason", "demand"}]}: how the last
# reconcile pass placed each adapter and why one is short. Written by it; read by status and explain.
ADAPTERS = f"{PREFIX}:adapters"

# --- external servers (engine: external) ----------------------------------------------------------
EXTERNALS = f"{PREFIX}:externals"  # set of the endpoint ids of external server urls


def external(endpoint_id: str) -> str:
    """JSON ExternalRecord: the health-check facts of one external url, written by `llmgw.external`."""
    return f"{PREFIX}:external:{endpoint_id}"


EXTERNAL_LOCK = f"{PREFIX}:lock:external"

# --- events and kicks ------------------------------------------------------------------------------
# Stream of what happened (catalog applied, replica Ready/failed/stopped, node lost, ...), capped.
EVENTS = f"{PREFIX}:events"


def event_gate(kind: str, subject: str) -> str:
    """String set NX with a short TTL by `Store.emit_limited`: while it exists, that kind of event about
    that subject (a model) is not written again, whichever process would write it."""
    return f"{PREFIX}:events:gate:{kind}:{subject}"


def kick_scheduled(task: str) -> str:
    """Set (NX, short TTL) while a kicked pass of `task` is on its way: a burst of facts sends one."""
    return f"{PREFIX}:kick:{task}"


def kick_dirty(task: str) -> str:
    """Set by every kick; cleared by the pass when it starts. Still set when the pass ends means a
    fact changed during the pass: it kicks itself again."""
    return f"{PREFIX}:dirty:{task}"


# --- model weights (docs/weights.md) ---------------------------------------------------------------
# Set of the remote sources (as written in the catalog) that have a facts record below.
WEIGHTS_SOURCES = f"{PREFIX}:weights:sources"


def _source_id(source: str) -> str:
    import hashlib

    return hashlib.sha256(source.encode()).hexdigest()[:20]


def weights_source(source: str) -> str:
    """JSON WeightsFacts of a remote source: its size and shape (for placement's disk and fit checks),
    or why they could not be read; written by the node agent that read its headers (an error with a
    short TTL, so it is read again)."""
    return f"{PREFIX}:weights:source:{_source_id(source)}"


def weights_claim(source: str) -> str:
    """String (NX, TTL): the node agent reading a source's headers now, so the others do not."""
    return f"{PREFIX}:weights:claim:{_source_id(source)}"


def weights_pulls(node: str) -> str:
    """Hash: source -> JSON {"layout", "requested_at"}: what `llmgw models pull` asks `node` to download."""
    return f"{PREFIX}:node:{node}:pulls"


def weights_pull_status(node: str) -> str:
    """Hash: source -> JSON PullStatus: how each pull on `node` is going (its agent writes it)."""
    return f"{PREFIX}:node:{node}:pull-status"


# --- Celery queues (the broker is this Redis: each queue is a list of that name) ------------------
# The control plane's tasks (reconcile, publish, housekeeping), consumed by the control workers.
CONTROL_QUEUE = "control"
NODE_QUEUE_PREFIX = "node-"


def node_queue(node: str) -> str:
    """The queue of `node`'s agent (`celery -A workers worker -Q node-<name>`): launch and stop tasks
    for the replicas placed there. The one spelling, for the control plane, the agent, `llmgw up`."""
    return NODE_QUEUE_PREFIX + node


# Hash of the control passes' counters: "<task>:passes", "<task>:seconds", "<task>:actions" (totals
# since the Redis started), for the benchmarks and the control-plane metrics.
CONTROL_STATS = f"{PREFIX}:stats:control"

# --- locks ---------------------------------------------------------------------------------------
RECONCILE_LOCK = f"{PREFIX}:lock:reconcile"
PUBLISH_LOCK = f"{PREFIX}:lock:publish"

# --- gateway: API keys, rate limits, usage ---------------------------------------------------------
# hash: key id -> JSON {name, hash, rpm, tpm, priority, created_at, models, expires_at, budget,
# budget_period, admin} (llmgw.state.keypolicy.ApiKeyRecord)
API_KEYS = f"{PREFIX}:apikeys"


def api_key_by_hash(key_hash: str) -> str:
    return f"{PREFIX}:apikey:{key_hash}"  # string: key id


def rate_window(key_id: str, kind: str, minute: int) -> str:
    return f"{PREFIX}:rl:{key_id}:{kind}:{minute}"


def traffic(slot: int) -> str:
    """Hash of one time slot of the gateways' traffic (gateway.traffic): `<model>:<field>` -> count,
    summed over every gateway process (HINCRBY), expiring a few minutes after the slot."""
    return f"{PREFIX}:traffic:{slot}"


def served(request_id: str) -> str:
    """JSON llmgw.state.served.Served: how the gateway served one request that asked to be explained
    (X-LLMGW-Explain), written by its gateway's usage flush, expiring SERVED_KEEP seconds later."""
    return f"{PREFIX}:served:{request_id}"


def usage(key_id: str) -> str:
    return f"{PREFIX}:usage:{key_id}"  # hash: "<model>:prompt" / "<model>:completion" / "<model>:requests"


def tenants(model: str) -> str:
    """Hash of what every gateway process counted per key on one model for fair queueing
    (llmgw.state.tenants: `n:<key id>` service in counter units, `t:` tokens of service, `w:` seconds
    waited in queues, `r:` requests sent), HINCRBYFLOAT'd by each exchange; expires when no gateway
    has written it for TENANTS_KEEP."""
    return f"{PREFIX}:tenants:{model}"


def tenants_minute(model: str, minute: int) -> str:
    """Hash of one minute (epoch seconds // 60) of a model's service per key: `<key id>` -> tokens
    (`llmgw usage` and the console take the keys' recent shares from it); expires after TENANTS_MINUTES."""
    return f"{PREFIX}:tenants:{model}:m{minute}"


TENANTS_KEEP = 86400.0  # seconds a model's tenant counters outlive the last write to them
TENANTS_MINUTES = 15  # minutes of per-minute service kept


def budget(key_id: str, period_id: str) -> str:
    """Integer: tokens a key with a budget spent in one UTC day or month (`llmgw.state.budget`),
    INCRBY'd by every gateway's usage flush; expires a while after the period ends."""
    return f"{PREFIX}:budget:{key_id}:{period_id}"


# --- engine credentials ------------------------------------------------------------------------------
# Hash: model name (or "*" for every model) -> how many times `llmgw engines rotate-credentials` ran
# for it. A replica created before the latest rotation of its model is outdated: the rolling update
# replaces it by one with a fresh secret (the secret itself is a control field of the replica record).
ENGINE_CREDENTIALS = f"{PREFIX}:engine-credentials"
ALL_MODELS = "*"

# --- the Batch API (docs/batch.md; llmgw.state.store.batches) -----------------------------------------
# The queue of the batch workers (`celery -A workers worker -Q batch`): `llmgw.batch.run` and the sweep.
BATCH_QUEUE = "batch"
# Sorted set: file id -> created_at, every stored file (uploads and batch outputs), for listing.
FILES = f"{PREFIX}:files"
# Sorted set: batch id -> created_at, every batch, for listing; set: the ids of batches not yet ended.
BATCHES = f"{PREFIX}:batches"
BATCHES_ACTIVE = f"{PREFIX}:batches:active"
# Hash: final status -> batches that ended so (completed, cancelled, expired): the metrics' counters.
BATCHES_ENDED = f"{PREFIX}:batches:ended"
# String: the batch workers' own API key (sent to the gateways when they require one). Kept raw, as the
# engines' secrets are: only llmgw's parts read Redis. Its record is an ordinary key named BATCH_KEY_NAME.
BATCH_CREDENTIAL = f"{PREFIX}:batch:credential"


def file_record(file_id: str) -> str:
    """Hash: one JSON field per FileRecord attribute."""
    return f"{PREFIX}:file:{file_id}"


def file_data(file_id: str) -> str:
    """List: an uploaded file's content in chunks of whole lines (RPUSH in order, LRANGE to read)."""
    return f"{PREFIX}:file:{file_id}:data"


def batch(batch_id: str) -> str:
    """Hash: one JSON field per BatchRecord attribute; the counters are integers the line writes
    HINCRBY (`n_completed`, `n_failed`, tokens, the output and error files' bytes)."""
    return f"{PREFIX}:batch:{batch_id}"


def batch_results(batch_id: str, kind: str) -> str:
    """Hash: line index -> the line of the output (`kind` "o") or error ("e") file. A line is written
    once, to one of the two (the record script checks both)."""
    return f"{PREFIX}:batch:{batch_id}:{kind}"


def batch_lease(batch_id: str) -> str:
    """String: the token of the run task feeding the batch now, with a TTL it renews."""
    return f"{PREFIX}:batch:{batch_id}:lease"


def batch_queued(batch_id: str) -> str:
    """String with a TTL: a run task was sent for the batch and has not started yet."""
    return f"{PREFIX}:batch:{batch_id}:queued"


def batch_feeders(model: str) -> str:
    """Hash: feeder token -> JSON {inflight, ts}: what each run task feeding `model` has in flight, so
    feeders of one model share its free capacity."""
    return f"{PREFIX}:batch:feeders:{model}"


def owner_files(owner: str) -> str:
    """Sorted set: file id -> created_at, the files of one owner (an API key id, or anonymous)."""
    return f"{PREFIX}:files:owner:{owner}"


def owner_batches(owner: str) -> str:
    """Sorted set: batch id -> created_at, the batches of one owner."""
    return f"{PREFIX}:batches:owner:{owner}"
