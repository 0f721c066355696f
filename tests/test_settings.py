"""A built-in data source or logger reads its keys from its config node (`launcher.base.settings`): its schema is the
one place of each key, and a key its schema lacks is still refused before start, naming the nearest one."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from hydra import compose, initialize_config_module

from launcher.base.settings import Settings
from launcher.config import ConfigError, freeze
from launcher.config.known import _schema_of, check_keys
from launcher.config.schema import SCHEMAS, register

register()  # the schemas stored, as the launcher stores them before it composes


def _frozen(*overrides: str):
    with initialize_config_module("launcher.conf", version_base="1.3"):
        return freeze(compose("config", overrides=list(overrides)))


@pytest.mark.unit
def test_settings_are_read_only() -> None:
    data = Settings(path="json", streaming=False)
    assert (data.path, data.streaming) == ("json", False)
    with pytest.raises(AttributeError):
        data.path = "csv"  # type: ignore[misc]
    with pytest.raises(AttributeError, match="split was not given"):
        data.split  # noqa: B018


BUILT_IN = [(group, schema) for group in ("data", "logger") for schema in SCHEMAS[group].values()]


@pytest.mark.unit
@pytest.mark.parametrize("group,schema", BUILT_IN, ids=[s.__name__ for _, s in BUILT_IN])
def test_a_target_that_takes_any_key_is_held_to_its_schema(group: str, schema: type) -> None:
    """Every built-in target either names its keys or takes `**keys` and has its schema found by its `_target_`
    (so that `check_keys` refuses what the schema lacks)."""
    from launcher.base.targets import locate

    target = next(f.default for f in dataclasses.fields(schema) if f.name == "_target_")
    if not isinstance(target, str) or target == "???":  # data=custom, logger=custom: the user's own
        return
    parameters = inspect.signature(locate(target)).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        assert _schema_of(target, group) is schema, (target, _schema_of(target, group))


@pytest.mark.unit
@pytest.mark.parametrize(
    "overrides,expected",
    [
        (
            ["data=hf", "data.path=json", "model.block_size=32", "+data.pathh=x"],
            "does not take data.pathh (it takes: cache_dir, columns, data_files, max_length, name, path, split_seed, "
            "streaming, text_field, tokenizer, val_fraction, val_split)",
        ),
        (["data=hf", "data.path=json", "model.block_size=32", "+data.pathh=x"], "did you mean data.path?"),
        (["data=tokens", "data.path=t.bin", "+data.seq_lenn=8"], "did you mean data.seq_len?"),
        (["logger=mlflow", "+logger.mlflow.experiments=x"], "did you mean logger.mlflow.experiment?"),
    ],
)
def test_a_key_a_built_in_target_does_not_take_is_one_line(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_keys(_frozen(*overrides))
    assert expected in str(refused.value), str(refused.value)
    assert "\n" not in str(refused.value)
