"""Every invalid catalog is refused with the field path it names and a clear reason, all problems at
once, and applying it (CLI or file watcher) changes nothing in Redis."""

from __future__ import annotations

import textwrap

import fakeredis
import pytest

from llmgw.catalog import apply_catalog, load_catalog_file, parse_catalog_text, sync_from_file
from llmgw.cli import catalog as cli_catalog
from llmgw.cli import main
from llmgw.errors import CatalogInvalid
from llmgw.state import keys
from llmgw.state.store import Store

SIM = "{name: s, engine: sim}"
GPU = "{class: h100}"


def one_model(profile: str, *, source: str = "", name: str = "m", extra: str = "") -> str:
    src = f"\n    source: {source}" if source else ""
    return f"models:\n  - name: {name}{src}{extra}\n    profiles:\n      - {profile}\n"


P = "models[0].profiles[0]"

# (id, catalog text, the path a problem must name, a fragment of its reason)
CASES: list[tuple[str, str, str, str]] = [
    ("unknown-top-level-key", "model: []\n", "model", "did you mean 'models'"),
    ("models-not-a-list", "models: {a: 1}\n", "models", "must be a list"),
    ("model-not-a-mapping", "models: [foo]\n", "models[0]", "must be a mapping"),
    ("model-without-name", f"models:\n  - profiles: [{SIM}]\n", "models[0].name", "required"),
    ("model-unknown-key", f"models:\n  - name: m\n    alias: [x]\n    profiles: [{SIM}]\n",
     "models[0].alias", "did you mean 'aliases'"),
    ("slo-duration-without-unit", f"models:\n  - name: m\n    slo: {{ttft: 500}}\n    profiles: [{SIM}]\n",
     "models[0].slo.ttft", "expected a duration with its unit such as 500ms"),
    ("slo-duration-bad-unit", f"models:\n  - name: m\n    slo: {{tpot: 80us}}\n    profiles: [{SIM}]\n",
     "models[0].slo.tpot", "expected a duration such as 500ms, 0.5s or 2s, got '80us'"),
    ("slo-unknown-key", f"models:\n  - name: m\n    slo: {{ttf: 1s}}\n    profiles: [{SIM}]\n",
     "models[0].slo.ttf", "did you mean 'ttft'"),
    ("slo-attainment-over-one", f"models:\n  - name: m\n    slo: {{ttft: 1s, attainment: 99}}\n    profiles: [{SIM}]\n",
     "models[0].slo.attainment", "must be at most 1"),
    ("routing-objective-unknown", f"models:\n  - name: m\n    routing: {{objective: fast}}\n    profiles: [{SIM}]\n",
     "models[0].routing.objective", "unknown objective 'fast' (expected one of: first_token, completion"),
    ("routing-unknown-key", f"models:\n  - name: m\n    routing: {{objectiv: completion}}\n    profiles: [{SIM}]\n",
     "models[0].routing.objectiv", "did you mean 'objective'"),
    ("model-name-with-space", one_model(SIM, name="'my model'"), "models[0].name", "without spaces"),
    ("duplicate-model-name", f"models:\n  - {{name: m, profiles: [{SIM}]}}\n  - {{name: m, profiles: [{SIM}]}}\n",
     "models[1].name", "duplicate model name 'm'"),
    ("alias-is-own-name", f"models:\n  - {{name: m, aliases: [m], profiles: [{SIM}]}}\n",
     "models[0].aliases[0]", "own name"),
    ("alias-is-other-model-name",
     f"models:\n  - {{name: a, aliases: [b], profiles: [{SIM}]}}\n  - {{name: b, profiles: [{SIM}]}}\n",
     "models[0].aliases[0]", "is the name of models[1]"),
    ("alias-shared-by-two-models",
     f"models:\n  - {{name: a, aliases: [x], profiles: [{SIM}]}}\n  - {{name: b, aliases: [x], profiles: [{SIM}]}}\n",
     "models[1].aliases[0]", "also an alias at models[0].aliases[0]"),
    ("alias-listed-twice", f"models:\n  - {{name: a, aliases: [x, x], profiles: [{SIM}]}}\n",
     "models[0].aliases[1]", "listed twice"),
    ("model-without-profiles", "models:\n  - {name: m, profiles: []}\n", "models[0].profiles", "at least one profile"),
    ("profiles-not-a-list", "models:\n  - {name: m, profiles: {name: s}}\n", "models[0].profiles", "must be a list"),
    ("duplicate-profile-name", f"models:\n  - {{name: m, profiles: [{SIM}, {SIM}]}}\n",
     "models[0].profiles[1].name", "duplicate profile name 's'"),
    ("profile-name-with-space", one_model("{name: 'a b', engine: sim}"), f"{P}.name", "letters, digits"),
    ("unknown-engine", one_model("{name: s, engine: vlm}"), f"{P}.engine", "unknown engine 'vlm'"),
    ("engine-missing", one_model("{name: s}"), f"{P}.engine", "required"),
    ("negative-replicas", one_model("{name: s, engine: sim, replicas: -1}"), f"{P}.replicas", "at least 0"),
    ("replicas-as-string", one_model("{name: s, engine: sim, replicas: '2'}"), f"{P}.replicas", "whole number"),
    ("replicas-as-boolean", one_model("{name: s, engine: sim, replicas: yes}"), f"{P}.replicas", "the boolean true"),
    ("priority-float", one_model("{name: s, engine: sim, priority: 1.5}"), f"{P}.priority", "whole number"),
    ("unknown-profile-key", one_model("{name: s, engine: sim, replica: 2}"), f"{P}.replica", "did you mean 'replicas'"),
    ("vllm-without-gpu", one_model("{name: g, engine: vllm}", source="org/model"), f"{P}.gpu", "vllm needs a GPU class"),
    # ... and the error names the explicit field that runs vLLM's CPU build instead.
    ("vllm-without-gpu-names-device", one_model("{name: g, engine: vllm}", source="org/model"), f"{P}.gpu",
     "or `device: cpu` to run vllm's CPU build"),
    ("device-cpu-with-gpu", one_model(f"{{name: g, engine: vllm, device: cpu, gpu: {GPU}}}", source="org/model"),
     f"{P}.device", "`device: cpu` and `gpu:` say different things"),
    ("device-gpu", one_model("{name: g, engine: vllm, device: gpu}", source="org/model"), f"{P}.device",
     "a GPU is asked for with `gpu: {class: ..., count: ...}`"),
    ("device-unknown", one_model("{name: g, engine: vllm, device: tpu}", source="org/model"), f"{P}.device",
     "must be `cpu`"),
    ("vllm-cpu-tensor-parallel", one_model("{name: g, engine: vllm, device: cpu, tensor_parallel: 2}", source="org/m"),
     f"{P}.tensor_parallel", "a CPU replica of vLLM (device: cpu) runs as one process on one node"),
    ("vllm-cpu-kv-env", one_model("{name: g, engine: vllm, device: cpu, env: {VLLM_CPU_KVCACHE_SPACE: '4'}}",
                                  source="org/m"),
     f"{P}.env.VLLM_CPU_KVCACHE_SPACE", "set by llmgw from the profile's `kv_cache_tokens`"),
    ("vllm-cpu-bind-env", one_model("{name: g, engine: vllm, device: cpu, env: {VLLM_CPU_OMP_THREADS_BIND: '0'}}",
                                    source="org/m"),
     f"{P}.env.VLLM_CPU_OMP_THREADS_BIND", "set by llmgw to the cores the replica's agent chose"),
    ("threads-on-gpu-vllm", one_model(f"{{name: g, engine: vllm, gpu: {GPU}, threads: 2}}", source="org/m"),
     f"{P}.threads", "only a CPU replica (`device: cpu`) takes `threads`"),
    ("threads-on-llamacpp", one_model("{name: l, engine: llamacpp, threads: 2}", source="/m.gguf"),
     f"{P}.threads", "'threads' is for vLLM's CPU build (device: cpu)"),
    ("vllm-gpu-count-mismatch", one_model(f"{{name: g, engine: vllm, tensor_parallel: 4, gpu: {{class: h100, count: 2}}}}",
                                          source="org/model"),
     f"{P}.gpu.count", "tensor_parallel x pipeline_parallel / nodes = 4 x 1 / 1 = 4 (got 2)"),
    ("vllm-uneven-nodes", one_model(f"{{name: g, engine: vllm, tensor_parallel: 3, nodes: 2, gpu: {GPU}}}",
                                    source="org/model"), f"{P}.nodes", "cannot be split evenly over 2 nodes"),
    ("llamacpp-tensor-parallel", one_model("{name: c, engine: llamacpp, tensor_parallel: 2}", source="/m.gguf"),
     f"{P}.tensor_parallel", "does not support tensor parallelism"),
    ("llamacpp-multi-node", one_model("{name: c, engine: llamacpp, nodes: 2}", source="/m.gguf"),
     f"{P}.nodes", "does not support multi-node"),
    ("gpu-without-class", one_model("{name: s, engine: sim, gpu: {count: 1}}"), f"{P}.gpu.class", "required"),
    ("gpu-count-zero", one_model("{name: s, engine: sim, gpu: {class: h100, count: 0}}"), f"{P}.gpu.count", "at least 1"),
    ("gpu-unknown-key", one_model("{name: s, engine: sim, gpu: {clas: h100}}"), f"{P}.gpu.clas", "did you mean 'class'"),
    ("gpu-not-a-mapping", one_model("{name: s, engine: sim, gpu: h100}"), f"{P}.gpu", "must be a mapping"),
    ("metric-name-illegal", one_model("{name: s, engine: sim, metrics: {running: 'bad name'}}"),
     f"{P}.metrics.running", "not a legal Prometheus metric name"),
    ("metrics-unknown-key", one_model("{name: s, engine: sim, metrics: {kv: x}}"), f"{P}.metrics.kv", "unknown field 'kv'"),
    ("weight-zero", one_model("{name: s, engine: sim, weight: 0}"), f"{P}.weight", "greater than 0"),
    ("start-timeout-negative", one_model("{name: s, engine: sim, start_timeout: -5}"), f"{P}.start_timeout", "greater than 0"),
    ("start-timeout-infinite", one_model("{name: s, engine: sim, start_timeout: .inf}"), f"{P}.start_timeout", "finite"),
    ("source-not-a-string", one_model("{name: s, engine: sim}", source="[a]"), "models[0].source", "must be a string"),
    ("capacity-zero", one_model("{name: s, engine: sim, capacity: 0}"), f"{P}.capacity", "at least 1"),
    ("tensor-parallel-zero", one_model("{name: s, engine: sim, tensor_parallel: 0}"), f"{P}.tensor_parallel", "at least 1"),
    ("env-value-not-string", one_model("{name: s, engine: sim, env: {FOO: 1}}"), f"{P}.env.FOO", "quote it"),
    ("env-bad-name", one_model("{name: s, engine: sim, env: {'A-B': x}}"), f"{P}.env", "not a valid environment variable"),
    ("env-reserved", one_model("{name: s, engine: sim, env: {CUDA_VISIBLE_DEVICES: '0'}}"),
     f"{P}.env.CUDA_VISIBLE_DEVICES", "set by llmgw"),
    ("args-port", one_model("{name: s, engine: sim, args: ['--port', '9000']}"), f"{P}.args[0]", "'--port' is set by llmgw"),
    ("args-tp-equals-form", one_model("{name: s, engine: sim, args: ['--tensor-parallel-size=2']}"), f"{P}.args[0]",
     "use the profile's `tensor_parallel`"),
    ("args-np", one_model("{name: c, engine: llamacpp, args: ['-np', '8']}", source="/m.gguf"), f"{P}.args[0]", "capacity"),
    ("args-not-a-list", one_model("{name: s, engine: sim, args: '--foo'}"), f"{P}.args", "must be a list"),
    ("args-item-number", one_model("{name: s, engine: sim, args: ['--max-model-len', 4096]}"), f"{P}.args[1]", "quote it"),
    ("node-selector-comma", one_model("{name: s, engine: sim, node_selector: {zone: 'a,b'}}"), f"{P}.node_selector",
     "can never match"),
    ("pool-bad-name", one_model("{name: s, engine: sim, pool: 'my pool'}"), f"{P}.pool", "letters, digits"),
    ("llamacpp-source-not-gguf", one_model("{name: c, engine: llamacpp}", source="org/model"), "models[0].source",
     "must end in .gguf"),
    ("llamacpp-no-source", one_model("{name: c, engine: llamacpp}"), "models[0].source", "needs a source"),
    ("llamacpp-profile-source-not-gguf",
     one_model("{name: c, engine: llamacpp, source: org/model}", source="/m.gguf"), f"{P}.source", "must end in .gguf"),
    ("vllm-pkg-source", one_model(f"{{name: g, engine: vllm, gpu: {GPU}}}", source="pkg:foo/m.gguf"), "models[0].source",
     "not pkg:"),
    ("pkg-source-malformed", one_model("{name: c, engine: llamacpp}", source="pkg:foo.gguf"), "models[0].source",
     "pkg:<package>/<file>"),
    ("hf-source-malformed", one_model("{name: c, engine: llamacpp}", source="hf://org"), "models[0].source",
     "expected hf://ORG/REPO[@REVISION][/FILE-OR-PATTERN]"),
    ("hf-source-bad-revision", one_model(f"{{name: g, engine: vllm, gpu: {GPU}}}", source="'hf://o/r@'"),
     "models[0].source", "empty revision after '@'"),
    ("hf-source-llamacpp-whole-repo", one_model("{name: c, engine: llamacpp}", source="hf://org/repo"),
     "models[0].source", "loads one GGUF file: name it or a pattern, e.g. hf://org/repo/*Q4_K_M.gguf"),
    ("hf-source-vllm-one-file", one_model(f"{{name: g, engine: vllm, gpu: {GPU}}}", source="hf://o/r/x.gguf"),
     "models[0].source", "loads a whole repository: write hf://o/r without a file or pattern"),
    ("url-source-credentials", one_model("{name: c, engine: llamacpp}", source="'https://u:p@h/m.gguf'"),
     "models[0].source", "credentials in a URL would be stored with the catalog"),
    ("url-source-vllm", one_model(f"{{name: g, engine: vllm, gpu: {GPU}}}", source="https://h/m.gguf"),
     "models[0].source", "not a single file from a URL"),
    ("url-source-scheme", one_model("{name: c, engine: llamacpp}", source="ftp://h/m.gguf"), "models[0].source",
     "unknown scheme ftp://"),
    ("url-source-bad-fragment", one_model("{name: c, engine: llamacpp}", source="'https://h/m.gguf#md5=1'"),
     "models[0].source", "#sha256=<64 hex digits>"),
    ("defaults-unknown-key", f"defaults: {{replica: 2}}\n{one_model(SIM)}", "defaults.replica", "did you mean 'replicas'"),
    ("defaults-name", f"defaults: {{name: x}}\n{one_model(SIM)}", "defaults.name", "cannot have a default"),
    ("defaults-source", f"defaults: {{source: x}}\n{one_model(SIM)}", "defaults.source", "belongs to a model"),
    ("defaults-bad-engine", f"defaults: {{engine: vlm}}\n{one_model('{name: s}')}", "defaults.engine", "unknown engine"),
    ("defaults-not-a-mapping", f"defaults: [1]\n{one_model(SIM)}", "defaults", "must be a mapping"),
    ("defaults-vllm-profile-without-gpu", f"defaults: {{engine: vllm}}\n{one_model('{name: g}', source='org/m')}",
     f"{P}.gpu", "vllm needs a GPU class"),
    ("duplicate-yaml-key", "models:\n  - name: m\n    profiles:\n      - name: s\n        engine: sim\n"
                           "        replicas: 1\n        replicas: 2\n",
     f"{P}.replicas", "duplicate key 'replicas' (line 7)"),
    ("external-without-url", one_model("{name: x, engine: external}"), f"{P}.url", "needs a url"),
    ("external-url-scheme", one_model("{name: x, engine: external, url: 'ftp://10.0.0.1'}"), f"{P}.url",
     "http:// or https://"),
    ("external-url-credentials", one_model("{name: x, engine: external, url: 'https://u:sk-123@api.example'}"),
     f"{P}.url", "holds credentials"),
    ("external-url-query-key", one_model("{name: x, engine: external, url: 'https://api.example?key=sk-1'}"),
     f"{P}.url", "no query string"),
    ("external-url-with-v1", one_model("{name: x, engine: external, url: [http://a:8000, 'http://b:8000/v1']}"),
     f"{P}.url[1]", "without the trailing /v1"),
    ("external-url-twice", one_model("{name: x, engine: external, url: [http://a:8000, 'http://a:8000/']}"),
     f"{P}.url[1]", "the same server as url[0]"),
    ("external-url-not-string", one_model("{name: x, engine: external, url: 8000}"), f"{P}.url", "a url or a non-empty list of urls"),
    ("external-replicas", one_model("{name: x, engine: external, url: http://a, replicas: 2}"), f"{P}.replicas",
     "list one `url` per server"),
    ("external-gpu", one_model(f"{{name: x, engine: external, url: http://a, gpu: {GPU}}}"), f"{P}.gpu",
     "does not apply to engine: external"),
    ("external-args", one_model("{name: x, engine: external, url: http://a, args: ['--x']}"), f"{P}.args",
     "llmgw does not start it"),
    ("external-env", one_model("{name: x, engine: external, url: http://a, env: {A: b}}"), f"{P}.env",
     "llmgw does not start it"),
    ("external-tensor-parallel", one_model("{name: x, engine: external, url: http://a, tensor_parallel: 2}"),
     f"{P}.tensor_parallel", "does not apply"),
    ("external-nodes", one_model("{name: x, engine: external, url: http://a, nodes: 2}"), f"{P}.nodes",
     "does not apply"),
    ("external-literal-key", one_model("{name: x, engine: external, url: http://a, api_key: sk-abc}"),
     f"{P}.api_key", "never written in the catalog"),
    ("external-key-in-env-name", one_model("{name: x, engine: external, url: http://a, api_key_env: sk-live-abc}"),
     f"{P}.api_key_env", "never the key itself"),
    ("external-unknown-server", one_model("{name: x, engine: external, url: http://a, server: tgi}"), f"{P}.server",
     "unknown server 'tgi'"),
    ("external-openai-metrics-without-running",
     one_model("{name: x, engine: external, url: http://a, metrics: {waiting: w}}"), f"{P}.metrics",
     "name at least its `running` series"),
    ("url-on-a-managed-profile", one_model("{name: s, engine: sim, url: http://a}"), f"{P}.url",
     "is for engine: external"),
    ("api-key-env-on-a-managed-profile", one_model("{name: s, engine: sim, api_key_env: K}"), f"{P}.api_key_env",
     "is for engine: external"),
    ("defaults-url", f"defaults: {{url: http://a}}\n{one_model(SIM)}", "defaults.url", "cannot have a default"),
    ("not-yaml", "models: [\n", "", "not valid YAML: line"),
    ("top-level-list", "- a\n- b\n", "", "must be a mapping"),
]


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def snapshot(r) -> dict:
    return {k: (r.type(k), r.get(k) if r.type(k) == "string" else r.lrange(k, 0, -1) if r.type(k) == "list"
                else r.hgetall(k) if r.type(k) == "hash" else None)
            for k in sorted(r.keys("*"))}


@pytest.fixture
def r():
    client = fakeredis.FakeRedis(decode_responses=True)
    base = parse_catalog_text(one_model("{name: s, engine: sim, replicas: 2}", name="base"))
    apply_catalog(Store(client), base, source="base.yaml", applied_by="test", now=1.0)
    return client


@pytest.mark.parametrize("case_id,text,path,fragment", CASES, ids=[c[0] for c in CASES])
def test_invalid_catalog_is_refused_with_its_path_and_changes_nothing(
    case_id, text, path, fragment, tmp_path, r, monkeypatch, capsys
):
    f = tmp_path / "catalog.yaml"
    f.write_text(text)
    with pytest.raises(CatalogInvalid) as exc:
        load_catalog_file(f)
    problems = exc.value.problems
    matching = [p for p in problems if p.path == path]
    assert matching, f"no problem at {path!r}; got {[str(p) for p in problems]}"
    assert any(fragment in p.reason for p in matching), [str(p) for p in matching]
    for p in problems:  # one clear line each, never pydantic's own wording
        assert "\n" not in str(p) and "pydantic" not in str(p) and "Input should" not in p.reason

    before = snapshot(r)
    monkeypatch.setattr(cli_catalog, "connect", lambda url, **kw: r)
    assert main(["catalog", "apply", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"{f}: {path + ': ' if path else ''}" in err and fragment in err
    assert snapshot(r) == before

    result = sync_from_file(Store(r), f, applied_by="watcher")
    assert not result.applied and result.version == 1 and result.problems
    after = snapshot(r)
    after.pop(keys.CATALOG_FILE_STATE)  # the watcher remembers what it saw (so it logs once), nothing else
    assert after == before


def test_all_problems_are_reported_at_once():
    text = textwrap.dedent("""\
        defaults: {replica: 1}
        models:
          - name: a
            aliases: [a]
            profiles:
              - {name: g, engine: vllm}
              - {name: c, engine: llamacpp, tensor_parallel: 2, replicas: -3}
          - name: a
            profiles: [{name: s, engine: simm}]
        """)
    with pytest.raises(CatalogInvalid) as exc:
        parse_catalog_text(text, "f.yaml")
    paths = {p.path for p in exc.value.problems}
    assert {
        "defaults.replica", "models[0].aliases[0]", "models[0].profiles[0].gpu", "models[0].profiles[1].replicas",
        "models[0].profiles[1].tensor_parallel", "models[0].source", "models[1].name", "models[1].profiles[0].engine",
    } <= paths, paths
    assert str(exc.value).startswith("f.yaml: ")


def test_problems_point_at_their_line():
    text = "models:\n  - name: m\n    profiles:\n      - name: s\n        engine: sim\n        replicas: -1\n"
    with pytest.raises(CatalogInvalid) as exc:
        parse_catalog_text(text)
    assert exc.value.problems[0].reason.endswith("(line 6)")


def test_unreadable_file_is_a_problem_not_a_traceback(tmp_path):
    with pytest.raises(CatalogInvalid) as exc:
        load_catalog_file(tmp_path / "missing.yaml")
    assert "cannot read" in str(exc.value)
