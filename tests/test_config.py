"""Config loading: defaults, the shipped YAML, and errors that name key, value and rule."""

from __future__ import annotations

from pathlib import Path

import pytest

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
    """README: configs/default.yaml lists every key with its default."""
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
    ("kv_cache.eviction_policy", "random", "'lru' or 'fifo'"),
    ("api.port", 70000, "less than or equal to 65535"),
    ("compute.prefill_cpus", [0, 0], "distinct"),
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
