"""The adapters: the names of torch's and DeepSpeed's that the launcher relies on beyond their public API are there on
the installed releases, with the parameters the adapters expect; a release that changed one fails in one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from strategies.checked import LibraryChanged, Private, resolve

pytestmark = pytest.mark.unit


def _stand_in(names: tuple[Private, ...], **replaced: Any) -> SimpleNamespace:
    """The installed library's objects that `names` start from, some replaced: a release as the tests imagine it."""
    found = {}
    for name in names:
        module, _, attributes = name.path.partition(":")
        first = attributes.split(".")[0]
        found[first] = resolve(f"{module}:{first}")
    return SimpleNamespace(**{**found, **replaced})


def test_torch_s_names_are_there_on_the_installed_release() -> None:
    from launcher.adapters import torch_private

    torch_private.check_elastic.cache_clear()
    torch_private.check_rendezvous.cache_clear()
    torch_private.check_elastic()
    torch_private.check_rendezvous()
    torch_private.check_torch(torch_private.HOOKS, where=_stand_in(torch_private.HOOKS))  # the stand-in's own copy


def test_a_torch_release_whose_agent_hook_changed_fails_in_one_line() -> None:
    """A hook renamed, or given another parameter, would leave the launcher's override never called: the failed
    group's 30 s wait back, and no word of it. The check names the hook, the version and what to do."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    from launcher.adapters import torch_private

    class Changed(SimpleElasticAgent):  # a release whose agent stops a group with one more parameter
        def _stop_workers(self, worker_group: Any, is_restart: bool = False) -> None:
            pass

    changed = _stand_in(torch_private.HOOKS, SimpleElasticAgent=Changed)
    with pytest.raises(LibraryChanged) as raised:
        torch_private.check_torch(torch_private.HOOKS, where=changed)
    line = str(raised.value)
    assert "\n" not in line
    assert "SimpleElasticAgent._stop_workers takes (self, worker_group, is_restart), not (self, worker_group)" in line
    assert "checked against torch 2.13.0: install torch==2.13.0, or update launcher/adapters/torch_private.py" in line

    class Gone:  # a release without the hook: torch's loop would never call the launcher's
        _monitor_workers = SimpleElasticAgent._monitor_workers
        _stop_workers = SimpleElasticAgent._stop_workers

    with pytest.raises(LibraryChanged, match=r"SimpleElasticAgent\._shutdown is gone; "):
        torch_private.check_torch(torch_private.HOOKS, where=_stand_in(torch_private.HOOKS, SimpleElasticAgent=Gone))


def test_a_torch_release_whose_rendezvous_join_changed_fails_in_one_line() -> None:
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    from launcher.adapters import torch_private

    class Join:
        def __call__(self, ctx: Any, deadline: float, round: int) -> Any:
            pass

    names = torch_private.RENDEZVOUS_NAMES
    with pytest.raises(LibraryChanged, match=r"_RendezvousJoinOp.__call__ takes \(self, ctx, deadline, round\), not"):
        torch_private.check_torch(names, where=_stand_in(names, _RendezvousJoinOp=Join))
    actions = SimpleNamespace(**{a.name: a for a in dr._Action if a.name != "ADD_TO_REDUNDANCY_LIST"})
    with pytest.raises(LibraryChanged, match=r"_Action.ADD_TO_REDUNDANCY_LIST is gone"):
        torch_private.check_torch(names, where=_stand_in(names, _Action=actions))


def test_a_resize_in_place_is_seen_inside_the_block_only() -> None:
    """The block's `resize_` sees each resize; after it, UntypedStorage has torch's inherited method again."""
    import torch

    from launcher.adapters.torch_private import resizes_seen

    seen: list[int] = []
    storage = torch.zeros(4).untyped_storage()
    with resizes_seen(lambda s: seen.append(s.nbytes())):
        storage.resize_(64)
        storage.resize_(0)
    storage.resize_(8)
    assert seen == [64, 0]
    assert "resize_" not in vars(torch.UntypedStorage) and storage.nbytes() == 8


def test_deepspeed_s_names_are_there_on_the_installed_release() -> None:
    import strategies.deepspeed.imported  # noqa: F401  # before any `import deepspeed`
    from strategies.deepspeed import zero

    zero._check_installed.cache_clear()
    zero.check_deepspeed()
    zero.check_deepspeed(where=_stand_in(zero.PRIVATE))


def test_a_deepspeed_release_whose_collective_changed_fails_in_one_line() -> None:
    """The counter sizes a collective by its largest tensor argument: a release whose entry point takes other
    parameters (hidden, as DeepSpeed's `timed_op` hides them, behind `*args, **kwargs`) is named, not counted
    differently without a word; a private method the state export calls, likewise."""
    import strategies.deepspeed.imported  # noqa: F401, I001  # before any `import deepspeed`
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from strategies.deepspeed import zero

    def timed(function: Any) -> Any:
        def log_wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        return log_wrapper

    @timed
    def all_gather_into_tensor(output_tensor: Any, tensor: Any, extra: Any, group: Any = None) -> None:
        pass

    changed = _stand_in(zero.PRIVATE, all_gather_into_tensor=all_gather_into_tensor)
    with pytest.raises(LibraryChanged) as raised:
        zero.check_deepspeed(where=changed)
    line = str(raised.value)
    assert line.startswith("deepspeed ") and "\n" not in line
    assert "deepspeed.comm:all_gather_into_tensor takes (output_tensor, tensor, extra, group), not (" in line
    assert "checked against deepspeed 0.19.8: install deepspeed==0.19.8, or update strategies/deepspeed/zero.py" in line

    class Stage3(DeepSpeedZeroOptimizer_Stage3):
        def _optimizer_states_and_gradient_swap_in(self, sub_group_id: int) -> None:  # type: ignore[override]
            pass

    with pytest.raises(LibraryChanged, match=r"_optimizer_states_and_gradient_swap_in takes \(self, sub_group_id\)"):
        zero.check_deepspeed(where=_stand_in(zero.PRIVATE, DeepSpeedZeroOptimizer_Stage3=Stage3))


def test_optuna_s_study_has_what_a_sampler_s_stop_needs() -> None:
    """A grid or brute-force sampler that tried every point calls `Study.stop()`, accepted only inside `optimize`;
    the sweeper's own loop marks the study so: on a release without those attributes, one line, not an
    AttributeError in the middle of a sweep."""
    import optuna

    from launcher.adapters.optuna_private import check_study, stop_allowed

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [0, 1]}, seed=0))
    check_study(study)
    for _ in range(2):
        trial = study.ask()
        trial.suggest_categorical("x", [0, 1])
        with stop_allowed(study) as stopped:
            study.tell(trial, 1.0)
    assert stopped() and not study._thread_local.in_optimize_loop  # the grid is done: the sampler said so
    older = SimpleNamespace(_thread_local=SimpleNamespace(in_optimize_loop=False))  # a study without `_stop_flag`
    with pytest.raises(LibraryChanged, match=r"^optuna \S+: optuna.study.study:Study._stop_flag is gone; .*optuna==5"):
        check_study(older)


def test_a_transformers_release_without_what_meta_builds_rely_on_fails_in_one_line(tmp_path: Path) -> None:
    """Inside the block a folder's config alone builds its model (no weights there to read); outside, as ever."""
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

    from launcher.adapters.transformers_private import NAMES, check_transformers, pretrained_from_config

    check_transformers()
    GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8).save_pretrained(tmp_path)
    with pretrained_from_config():
        built = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert built.config.n_embd == 8 and built.config.vocab_size == 16
    with pytest.raises(OSError):  # no weights in the folder
        GPT2LMHeadModel.from_pretrained(tmp_path)
    assert isinstance(vars(PreTrainedModel)["from_pretrained"], classmethod)  # transformers' own, back

    class Changed(PreTrainedModel):
        @classmethod
        def _from_config(cls, config: Any, dtype: Any, **kwargs: Any) -> Any:
            pass

    with pytest.raises(LibraryChanged, match=r"PreTrainedModel._from_config takes \(config, dtype, kwargs\), not"):
        check_transformers(where=_stand_in(NAMES, PreTrainedModel=Changed))

    class Inherited(PreTrainedModel):  # from_pretrained not its own: the block could not put it back
        pass

    with pytest.raises(LibraryChanged, match=r"PreTrainedModel.from_pretrained is not its own classmethod"):
        check_transformers(where=_stand_in(NAMES, PreTrainedModel=Inherited))
