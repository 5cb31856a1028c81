"""Config loading: defaults, the shipped YAML, and errors that name key, value and rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from mm_serve.cluster.worker_specs import engine_sizing
from mm_serve.config import ConfigError, dump_config, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_shipped_default_config_loads_and_round_trips(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "default.yaml")
    assert cfg.mode == "disaggregated"
    assert cfg.kv_cache.page_size == 16 and cfg.scheduler.ring_buffer_size == 16
    out = tmp_path / "c.yaml"
    out.write_text(dump_config(cfg))
    assert load_config(out) == cfg


def test_default_yaml_lists_every_key_with_its_default() -> None:
    """docs/configuration.md: configs/default.yaml lists every key with its default."""
    import yaml

    from mm_serve.config import ServiceConfig

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    shipped = flat(yaml.safe_load((ROOT / "configs" / "default.yaml").read_text()))
    defaults = flat(ServiceConfig().model_dump())
    assert sorted(shipped) == sorted(defaults)
    assert shipped == defaults


@pytest.mark.parametrize("key,value,fragment", [
    ("scheduler.ring_buffer_size", 12, "power of two"),
    ("kv_cache.page_size", 0, "greater than or equal to 1"),
    ("mode", "sideways", "'disaggregated' or 'colocated'"),
    ("kv_cache.eviction_policy", "random", "'lru'"),
    ("api.port", 70000, "less than or equal to 65535"),
    ("compute.prefill_cpus", [0, 0], "distinct"),
    ("kv_cache.enable_prefix_caching", 1, "valid boolean"),
    ("kv_cache.enable_prefix_caching", "no", "valid boolean"),
    ("cache.encoder_cache_bytes", True, "valid integer"),
    ("cache.encoder_cache_bytes", -1, "greater than or equal to 0"),
    ("scheduler.prefill_chunk_tokens", 2.5, "valid integer"),
    ("scheduler.cache_aware_balance_tokens", "lots", "valid integer"),
    ("scheduler.prefill_routing", "round_robin", "'cache_aware' or 'least_queued'"),
    ("api.event_loop", "trio", "'auto', 'asyncio' or 'uvloop'"),
    ("api.http_parser", "h2", "'auto', 'h11' or 'httptools'"),
    ("api.shutdown_grace_s", float("nan"), "finite number"),  # was "less than or equal to 3600"
    ("api.timeout_ms", float("inf"), "finite number"),
    ("placement.workload", "chatbott", "unknown workload 'chatbott': choose auto, chatbot, code"),
    ("placement.workload", "/no/such/workload.jsonl", "or the path of a JSONL workload file"),
    ("placement.front_end_ms_per_token", -0.1, "greater than or equal to 0"),
    ("placement.front_end_ms_per_token", 250, "less than or equal to 100"),
    ("placement.front_end_ms_per_token", float("nan"), "finite number"),
])
def test_bad_values_name_key_value_and_rule(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {key: value})
    message = str(info.value)
    assert key in message and repr(value) in message and fragment in message


def test_unknown_key_lists_allowed_keys() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache.page_sise: unknown key; allowed here: .*page_size"):
        load_config(None, {"kv_cache.page_sise": 8})


def test_gpu_list_must_match_worker_counts() -> None:
    with pytest.raises(ConfigError, match="prefill_gpus lists 1 GPUs but"):
        load_config(None, {"compute.prefill_workers": 2, "compute.prefill_gpus": [0]})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(bad)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.compute.prefill_workers >= 1 and cfg.compute.decode_workers >= 1
    for cpu in cfg.compute.prefill_cpus + cfg.compute.decode_cpus:
        assert 0 <= cpu < 2  # the shipped configs target the 2-core CPU machine


def test_colocated_llm_takes_the_service_config_then_keywords(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    from mm_serve import LLM
    from mm_serve.config import config_from_dict

    service = config_from_dict({}, {"cpu_gemm": "torch", "kv_cache.max_pages_per_gpu": 96, "seed": 7})
    llm = LLM(model=tiny_llama, mode="colocated", config=service, max_running=5)
    cfg = llm.engine.config
    assert (cfg.cpu_gemm, cfg.num_pages, cfg.seed, cfg.max_running) == ("torch", 96, 7, 5)


@pytest.mark.parametrize("kwargs,match", [
    ({"prefill_workers": 1}, "unknown LLM arguments \\['prefill_workers'\\] for mode='colocated'"),
    ({"num_pages": "many"}, "num_pages must be an integer"),
    ({"seed": 1.5}, "seed must be an integer"),
    ({"enforce_eager": "yes"}, "enforce_eager must be true or false"),
    ({"dtype": ["float32"]}, "dtype must be one of"),
    ({"cpu_gemm": "blas"}, "cpu_gemm must be 'onednn' or 'torch'"),
])
def test_colocated_llm_bad_keywords_are_value_errors(tiny_llama, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    from mm_serve import LLM

    with pytest.raises(ValueError, match=match):
        LLM(model=tiny_llama, mode="colocated", **kwargs)


def test_colocated_llm_checks_the_service_config(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    from mm_serve import LLM
    from mm_serve.config import config_from_dict

    with pytest.raises(ConfigError, match="tensor_parallel"):
        LLM(model=tiny_llama, mode="colocated", config=config_from_dict({}, {"compute.prefill_tensor_parallel": 2}))
    with pytest.raises(ValueError, match="config must be a ServiceConfig"):
        LLM(model=tiny_llama, mode="colocated", config={"seed": 3})  # type: ignore[arg-type]


def test_an_http_stack_that_is_not_installed_is_a_cli_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``api.event_loop: uvloop`` / ``api.http_parser: httptools`` without the package: a clear
    error before any worker starts (uvicorn would fail only after the warm-up); auto and the pure
    Python choices need nothing."""
    import importlib.util

    from mm_serve.cli.main import CLIError
    from mm_serve.cli.serve import _check_http_stack

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("uvloop", "httptools") else real(name, *a))
    with pytest.raises(CLIError, match=r"api.event_loop is 'uvloop' but uvloop is not installed"):
        _check_http_stack("uvloop", "auto")
    with pytest.raises(CLIError, match=r"api.http_parser is 'httptools' but httptools is not installed"):
        _check_http_stack("auto", "httptools")
    _check_http_stack("auto", "auto")
    _check_http_stack("asyncio", "h11")


def test_a_tier_given_in_part_keeps_the_defaults_of_the_rest() -> None:
    """``slo.tiers.standard.ttft_ms`` alone changes only that key; a bad value still names its key,
    and the tiers must still be ordered."""
    cfg = load_config(None, {"slo.tiers.standard.ttft_ms": 2000})
    assert (cfg.slo.tiers.standard.ttft_ms, cfg.slo.tiers.standard.tpot_ms, cfg.slo.tiers.standard.attainment) == \
        (2000, 250, 0.9)
    assert cfg.slo.tiers.batch.ttft_ms == 60_000
    with pytest.raises(ConfigError, match="slo.tiers.standard.tpot_ms"):
        load_config(None, {"slo.tiers.standard.tpot_ms": -1})
    with pytest.raises(ConfigError, match="at least as tight as slo.tiers.standard"):
        load_config(None, {"slo.tiers.interactive.ttft_ms": 5000})


def test_decode_pacing_must_stay_below_the_tightest_tpot_slo() -> None:
    """``scheduler.decode_step_interval_ms`` at or above the interactive tier's TPOT SLO would make
    every interactive request miss: a config error naming both keys."""
    assert load_config(None, {"scheduler.decode_step_interval_ms": 75}).scheduler.decode_step_interval_ms == 75
    with pytest.raises(ConfigError, match=r"decode_step_interval_ms \(100\).*interactive.tpot_ms \(100\)"):
        load_config(None, {"scheduler.decode_step_interval_ms": 100})
    with pytest.raises(ConfigError, match="decode_step_interval_ms"):
        load_config(None, {"scheduler.decode_step_interval_ms": -1})
    with pytest.raises(ConfigError, match="decode_step_interval_ms"):  # YAML `true` is not 1 ms
        load_config(None, {"scheduler.decode_step_interval_ms": True})


def test_decode_pacing_by_rule_is_a_fraction_and_excludes_a_fixed_interval() -> None:
    """``scheduler.decode_step_pacing`` is a fraction of the running requests' TPOT SLO in [0, 1); with
    ``decode_step_interval_ms`` as well it is a config error naming both; the workers get the tiers'
    TPOT SLOs in seconds by rank."""
    cfg = load_config(None, {"scheduler.decode_step_pacing": 0.7, "slo.tiers.standard.tpot_ms": 110})
    sizing = engine_sizing(cfg)
    assert (sizing.decode_step_pacing, sizing.decode_step_interval_s) == (0.7, 0.0)
    assert sizing.tier_tpot_s == (0.1, 0.11, 2.0)
    for bad in (1.0, -0.1, True):
        with pytest.raises(ConfigError, match="decode_step_pacing"):
            load_config(None, {"scheduler.decode_step_pacing": bad})
    with pytest.raises(ConfigError, match="decode_step_interval_ms and scheduler.decode_step_pacing"):
        load_config(None, {"scheduler.decode_step_pacing": 0.5, "scheduler.decode_step_interval_ms": 50})


def test_settings_that_do_nothing_with_the_rest_of_the_config_are_named() -> None:
    """Valid but inert: pacing every step with no pacing set, pacing in colocated mode, a Ray cluster's keys with
    the local backend (one line each)."""
    assert load_config(None, {}).ineffective_settings() == []
    assert load_config(None, {"scheduler.decode_step_pacing": 0.7,
                              "scheduler.decode_pacing_always": True}).ineffective_settings() == []
    lines = load_config(None, {"scheduler.decode_pacing_always": True}).ineffective_settings()
    assert len(lines) == 1 and lines[0].startswith("scheduler.decode_pacing_always has no effect")
    lines = load_config(None, {"mode": "colocated", "scheduler.decode_step_interval_ms": 40}).ineffective_settings()
    assert len(lines) == 1 and "no effect in colocated mode" in lines[0]
    lines = load_config(None, {"mode": "colocated", "compute.prefill_workers": 2}).ineffective_settings()
    assert lines == ["compute.prefill_workers (2) has no effect in colocated mode: one worker runs both phases (on "
                     "the cores of compute.prefill_cpus and compute.decode_cpus)"]
    assert load_config(None, {"mode": "colocated", "compute.prefill_workers": 1}).ineffective_settings() == []
    lines = load_config(None, {"cluster.address": "10.0.0.1:6379", "cluster.advertise_host": "10.0.0.2"}
                        ).ineffective_settings()  # --ray-address without --cluster-backend ray
    assert lines == ["cluster.address and cluster.advertise_host have no effect with cluster.backend local "
                     "(--cluster-backend ray joins a Ray cluster)"]
    assert load_config(None, {"cluster.address": "auto"}).ineffective_settings() == []  # the default, written out


def test_a_bad_value_in_the_file_is_an_error_even_when_a_flag_overrides_it(tmp_path: Path) -> None:
    """The file is validated on its own: ``--port 8124`` does not hide ``api.port: 70000`` in it."""
    path = tmp_path / "bad.yaml"
    path.write_text("api:\n  port: 70000\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid configuration:\n  api\.port = 70000"):
        load_config(path, {"api.port": 8124})
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid configuration:\n  api\.port = 70000"):
        load_config(path)  # without overrides (mm-serve caption --config) the message names the file too
    path.write_text("api:\n  port: 9000\n")
    assert load_config(path, {"api.port": 8124}).api.port == 8124


def test_api_keys_one_or_several_and_salting_by_key_needs_them() -> None:
    """``api.api_key`` takes one key or a list (one per tenant); an empty key in a list, a key with a
    space, and salting by key without any key are errors naming the rule."""
    assert load_config(None, {"api.api_key": "a"}).api.api_keys == ("a",)
    assert load_config(None, {"api.api_key": ["a", "b"]}).api.api_keys == ("a", "b")
    for value, fragment in (("", "empty api_key"), (["a", ""], "empty api_key"), (["a", "b c"], "without spaces")):
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, {"api.api_key": value})
    with pytest.raises(ConfigError, match="cache_salt_by_api_key needs api_key"):
        load_config(None, {"api.cache_salt_by_api_key": True})
    assert load_config(None, {"api.api_key": ["a", "b"], "api.cache_salt_by_api_key": True}).api.cache_salt_by_api_key


def test_api_key_flag_given_twice_is_a_list_of_tenants() -> None:
    from mm_serve.cli.main import build_parser
    from mm_serve.cli.serve import _overrides

    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b", "--cache-salt-by-api-key"])
    cfg = load_config(None, _overrides(args))
    assert cfg.api.api_keys == ("a", "b") and cfg.api.cache_salt_by_api_key
    assert load_config(None, _overrides(build_parser().parse_args(["serve", "--api-key", "a"]))).api.api_key == "a"
