"""The shape of a pipeline: its schedules, how many stages each rank holds, and the split of a model's layer list
into stages (by layers or by parameters, or where `strategy.pp_split` says). What `launch plan` reads
(`launcher.plan.pipeline`) and the strategy builds from (`strategies.pipeline`); nothing here runs a stage."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv")
"""strategy.pp_schedule's choices: torch's ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B,
ScheduleInterleavedZeroBubble and ScheduleZBVZeroBubble."""
LOOPED = ("interleaved_1f1b", "interleaved_zero_bubble", "zbv")
"""The schedules that hold several stages per rank (strategy.pp_stages_per_rank; zbv: exactly 2, in a V)."""
ZERO_BUBBLE = ("interleaved_zero_bubble", "zbv")
"""The schedules that split each backward in two: the inputs' gradients, then the weights'."""
BALANCE = ("layers", "params")


def layer_list(model: nn.Module) -> str | None:
    """The path of the model's layer list: the `nn.ModuleList` of two or more entries of one class holding the most
    parameters (the built-in GPT's `blocks`, a transformers causal LM's `model.layers` or `transformer.h`)."""
    best, size = None, -1
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 1 and len({type(c) for c in m}) == 1:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = name, n
    return best


def outside(model: nn.Module, path: str) -> dict[str, str]:
    """Each module outside the layer list holding parameters of its own: "pre" (registered before the list: the
    first stage's) or "post" (after it: the last stage's)."""
    found, seen = {}, False
    for name, m in model.named_modules():
        if name == path:
            seen = True
        if name == path or name.startswith(path + ".") or not any(True for _ in m.parameters(recurse=False)):
            continue
        found[name] = "post" if seen else "pre"
    return found


@dataclass(frozen=True)
class Split:
    """The stages: the layer list's path, each stage's layers [lo, hi), and the modules outside the list."""

    path: str
    ranges: tuple[tuple[int, int], ...]
    roles: dict[str, str]

    def describe(self) -> str:
        return ", ".join(f"{i}: {self.path}.{lo}-{hi - 1}" for i, (lo, hi) in enumerate(self.ranges))


def stage_count(schedule: str, size: int, per_rank: int) -> int:
    """Stages in all: one per rank, or pp_stages_per_rank per rank for the looped schedules (zbv: 2)."""
    if schedule == "zbv":
        return 2 * size
    return size * per_rank if schedule in LOOPED else size


def held_stages(schedule: str, size: int, per_rank: int, pp_rank: int) -> list[int]:
    """The stages a pipeline rank holds: its own; looped, every P-th from its own; zbv, its own and its mirror."""
    if schedule == "zbv":
        return [pp_rank, 2 * size - 1 - pp_rank]
    if schedule in LOOPED:
        return [pp_rank + v * size for v in range(per_rank)]
    return [pp_rank]


def plan_split(model: nn.Module, stages: int, given: list[int] | None, balance: str, size: int, schedule: str) -> Split:
    """The split of a model (on meta) into `stages`; ValueError (one line, the fix) where it cannot be made."""
    path = layer_list(model)
    if path is None:
        raise ValueError(
            f"strategy.pp_size={size}: {type(model).__name__} has no layer list the launcher can split (an "
            "nn.ModuleList of two or more layers of one class); hold the layers in one nn.ModuleList and name where "
            "each stage after the first begins, e.g. strategy.pp_split=[4]"
        )
    layers = model.get_submodule(path)
    n = len(layers)
    if given is not None:
        starts = [int(s) for s in given]
        if len(starts) != stages - 1 or starts != sorted(set(starts)) or starts[0] < 1 or starts[-1] >= n:
            raise ValueError(
                f"strategy.pp_split={starts} does not split {path}'s {n} layers into the {stages} stages of "
                f"strategy.pp_size={size} and pp_schedule={schedule}: give {stages - 1} increasing layer indices "
                f"between 1 and {n - 1}, where each stage after the first begins"
            )
        bounds = [0, *starts, n]
        return Split(path, tuple(zip(bounds[:-1], bounds[1:])), outside(model, path))
    if stages > n:
        raise ValueError(
            f"strategy.pp_size={size} with pp_schedule={schedule} makes {stages} stages, more than {path}'s {n} "
            "layers; use fewer stages (pp_size, pp_stages_per_rank) or a deeper model"
        )
    roles = outside(model, path)
    if balance == "layers":
        per, extra = divmod(n, stages)
        sizes = [per + (1 if s < extra else 0) for s in range(stages)]
    else:
        sizes = _by_params(model, path, roles, stages)
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return Split(path, tuple(zip(bounds[:-1], bounds[1:])), roles)


def _by_params(model: nn.Module, path: str, roles: dict[str, str], stages: int) -> list[int]:
    """Layers per stage such that the largest stage's parameters (the first's with the modules before the list, the
    last's with those after it) are the fewest; of the splits that reach it, the one whose cuts come first (each stage
    begins as early as it can). By dynamic programming over (first layer, stages left): stages x layers² steps, where
    trying every split would take C(layers - 1, stages - 1)."""
    import functools
    import itertools

    layers = model.get_submodule(path)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    pre = sum(p.numel() for n, r in roles.items() if r == "pre" for p in model.get_submodule(n).parameters(False))
    post = sum(p.numel() for n, r in roles.items() if r == "post" for p in model.get_submodule(n).parameters(False))
    n, sums = len(sizes), [0, *itertools.accumulate(sizes)]

    def load(lo: int, hi: int) -> int:
        return sums[hi] - sums[lo] + (pre if lo == 0 else 0) + (post if hi == n else 0)

    @functools.cache
    def least(lo: int, parts: int) -> int:
        """The smallest largest load of layers[lo:] split into `parts` stages."""
        if parts == 1:
            return load(lo, n)
        return min(max(load(lo, hi), least(hi, parts - 1)) for hi in range(lo + 1, n - parts + 2))

    target, bounds = least(0, stages), [0]
    for parts in range(stages, 1, -1):
        lo = bounds[-1]
        bounds.append(next(h for h in range(lo + 1, n - parts + 2) if max(load(lo, h), least(h, parts - 1)) <= target))
    bounds.append(n)
    return [hi - lo for lo, hi in zip(bounds[:-1], bounds[1:])]


def microbatch_problem(schedule: str, size: int, microbatches: int) -> str | None:
    """Why a schedule cannot run K micro-batches on P pipeline ranks (None: it can). Fewer than P leave a stage
    without work (torch refuses it for 1F1B; other schedules hang or fail on some layouts); the interleaved ones also
    need K a multiple of their rounds, max(1, K // P)."""
    if schedule == "gpipe":
        return None
    if microbatches < size:
        return f"needs at least pp_size={size} micro-batches per step"
    rounds = max(1, microbatches // size)
    if schedule in ("interleaved_1f1b", "interleaved_zero_bubble") and microbatches % rounds:
        return f"needs the micro-batches a multiple of its rounds ({rounds} = K // pp_size)"
    return None
