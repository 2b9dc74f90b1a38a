"""Job configuration: the pydantic models of DESIGN.md §9, YAML loading and `--set` overrides.

Every mistake a user can make in a config is caught here, before any process starts, with a
message that names the field and says how to fix it. Unknown keys are errors, not ignored.

Parallel layout rule (Megatron-core's, with context parallelism = 1):
    job.world_size = parallel.tp × parallel.pp × parallel.dp
Expert parallelism is folded into the data-parallel ranks: experts use the same tensor-parallel
size as the dense layers, parallel.ep must divide parallel.dp, and the expert-data-parallel size
is dp / ep. `parallel.dp` may be left out; it is then derived from the world size.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

BUILTIN_PROGRAMS = ("builtin:moe_gpt",)


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobConfig(_Strict):
    program: str = Field("builtin:moe_gpt", description="builtin:moe_gpt or a path to a training script")
    args: list[str] = Field(default_factory=list, description="arguments passed to a script program")
    world_size: int = Field(..., ge=1)
    iterations: int = Field(6, ge=1, description="training steps run, warm-up steps included")
    warmup: int = Field(1, ge=0, description="first steps left out of the timing")
    device: Literal["cpu"] = "cpu"
    device_memory_bytes: int | None = Field(None, ge=1, description="device capacity, for OOM")
    seed: int = 1234
    timeout_s: float = Field(600.0, gt=0, description="wall-clock limit of one launch")
    cpu_binding: Literal["core", "none"] = Field(
        "core", description="core: each real rank process on a core of its own when the machine has enough "
                            "(prism_core/launch/cores.py); none: wherever the scheduler puts it")

    @property
    def is_builtin(self) -> bool:
        return self.program.startswith("builtin:")


class ModelConfig(_Strict):
    """Shape and training options of the built-in `moe_gpt` workload (Qwen3-MoE-like)."""

    vocab_size: int = Field(256, ge=2)
    hidden_size: int = Field(64, ge=1)
    num_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_query_groups: int = Field(2, ge=1, description="key/value heads (GQA)")
    head_dim: int | None = Field(None, ge=2, description="defaults to hidden_size / num_attention_heads")
    moe_ffn_hidden_size: int = Field(64, ge=1)
    num_experts: int = Field(4, ge=1)
    moe_router_topk: int = Field(2, ge=1)
    moe_aux_loss_coeff: float = Field(1e-2, ge=0)
    moe_router: Literal["learned", "balanced"] = Field(
        "learned", description="balanced: round-robin expert choice, data-independent all-to-all sizes")
    seq_length: int = Field(32, ge=2)
    micro_batch_size: int = Field(2, ge=1)
    rope_theta: float = Field(10000.0, gt=0)
    norm_eps: float = Field(1e-6, gt=0)
    init_std: float = Field(0.02, gt=0)
    tie_embeddings: bool = False
    attention: Literal["sdpa", "naive"] = "sdpa"
    recompute: bool = False
    optimizer: Literal["adam", "sgd"] = "adam"
    lr: float = Field(3e-3, gt=0)

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads


class ParallelConfig(_Strict):
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    vpp: int = Field(1, ge=1, description="virtual pipeline stages (model chunks) per pp rank")
    dp: int | None = Field(None, ge=1, description="derived from the world size when left out")
    ep: int = Field(1, ge=1)
    microbatches: int = Field(1, ge=1, description="microbatches per data-parallel rank per step")
    distributed_optimizer: bool = False
    overlap_p2p: bool = True


class EmulationConfig(_Strict):
    slots: int = Field(2, ge=1, description="K: rank processes running at once")
    sandbox: int = Field(1, ge=1, description="S: real ranks per slice")
    ranks_of_interest: list[int] = Field(default_factory=lambda: [0], min_length=1)
    collect_mode: Literal["context_switch", "rules"] = "context_switch"
    timing_passes: int = Field(2, ge=1, le=4, description="slice timing passes, each with its slices' loaded runs: "
                                                         "the first replays virtual ranks as fast as the graph "
                                                         "allows, each further one in the previous pass's calibrated "
                                                         "time, as an emulation does (pace_reference: timed reads "
                                                         "the last one's)")
    loaded_compute: bool = Field(True, description="slices bound to cores run once more beside neighbours "
                                                   "(emulation.neighbours), and compute nodes take their spans from "
                                                   "that run: in the full job a rank's neighbours compute too, "
                                                   "sharing its caches and memory")
    resume_cost: bool = Field(True, description="calibration moves each compute span from the wait it was measured "
                                                "after to the wait its timeline puts before it, at the cost of a "
                                                "wait fitted from the slices' plain and loaded runs "
                                                "(calibrate/resume.py): a co-run's ranks wait longer than the job's")
    co_run_assistant: Literal["idle", "normal"] = Field(
        "idle", description="the scheduling class of a co-run member's assistant, which shares its sandbox ranks' "
                            "cores: idle, it runs only while they wait, so that their compute spans hold none of "
                            "its work (replay/slices.py run_with_assistant); normal, it takes the core as any thread")
    keep_awake: bool = Field(True, description="a plain slice placed alone keeps its assistant's cores from idling "
                                               "(a spin in the idle class, launch/neighbour_load.py): in the full job "
                                               "the other ranks' cores compute, and a core that idled milliseconds "
                                               "wakes late on a machine whose idle cores halt")
    follow_pace: bool = Field(True, description="a timed run (an emulation) scales its virtual ranks' compute by "
                                                 "the pace its sandbox ranks compute at against their calibrated "
                                                 "spans, so that a host whose speed moved since the timing moves them "
                                                 "too (replay/follow.py)")
    pace_reference: Literal["alone", "loaded", "timed"] = Field(
        "timed", description="what a followed pace is read against: timed, the sandbox ranks' compute in their "
                             "slices of a second timing pass, which replay in calibrated time as an emulation does "
                             "(the calibrated spans times that compute over the same pass's loaded runs' at equal "
                             "waits; bench/MEASURED.md item 61), or where the timeline has one pass, as loaded; "
                             "loaded, the calibrated spans (a neighbour computing beside them; an emulated rank "
                             "computed 0.97-1.00 of its record's same rank from day to day, items 42-60, and its "
                             "virtual peers followed it); alone, the timeline's alone spans whatever the pass, of a "
                             "first pass its plain slices' (calibrate/durations.py alone_factor), 4% too fast in "
                             "item 42")
    pace_steps: int = Field(10, ge=1, description="a followed pace is read over up to this many steps of the sandbox "
                                                  "ranks' compute: the machine's drift, not one step's noise, which "
                                                  "the calibrated spans carry already")
    virtual_spans: Literal["matched", "paired", "steady", "timed"] = Field(
        "matched", description="what a timed run's virtual ranks compute each node in: steady, in steps after the "
                              "warm-up that run the rank's usual nodes, its position's trimmed mean over them, so "
                              "that a virtual rank's noise is not drawn apart from its sandbox peers' "
                              "(replay/steady.py; bench/MEASURED.md item 45); timed, the calibrated span of that "
                              "node in that step, one draw of the timing run's noise, which virtual ranks waiting "
                              "for each other need; paired, steady for the virtual ranks whose every peer is a "
                              "sandbox rank and timed for the rest; matched, as paired, but each steady rank keeps "
                              "the share of its timed noise that the calibrated timeline shows its sandbox peers "
                              "do not share with it, counted as far as the timeline runs their nodes at once "
                              "(steady.py shared_noise, kept_noise: none where they share half or more; "
                              "bench/MEASURED.md items 47-49)")
    build_ahead: bool = Field(True, description="a timed run builds what its virtual ranks send in a ring (the "
                                                "partials folded from the tensor cache) while they compute up to "
                                                "the op, as a real rank has its data at hand when it arrives "
                                                "(replay/assistant.py _build_ahead); false: when the op comes due")
    ring_combine: bool = Field(True, description="a virtual rank between two sandbox ranks on a ring (every virtual "
                                                 "rank of a W=2 ring) combines what it receives at each reduce step "
                                                 "with its own input's chunk before it sends on, as a real member "
                                                 "does (replay/ring.py): what it sends comes from the tensor cache, "
                                                 "so only its time changes, which the sandbox rank waits for")
    virtual_ranks: Literal["all", "neighbours"] = Field(
        "neighbours", description="the emulation's assistant replays only the virtual ranks the sandbox ranks talk "
                                  "to, the ring, tree and barrier neighbours and point-to-point peers, reading only "
                                  "their rows of the graph (neighbours, the paper's active virtual ranks: memory and "
                                  "replay work follow the sandbox's neighbourhood, not W; replay/hosted.py), or "
                                  "every virtual rank (all: a late sandbox rank's delay also travels through virtual "
                                  "ranks that never talk to it and back). Where every virtual rank is a neighbour "
                                  "(W=2) the two are the same run. Timing slices always host all")
    awake_while_computing: bool = Field(True, description="a timed run placed alone (an emulation, a second timing "
                                                          "pass) keeps its assistant's cores awake while its virtual "
                                                          "ranks compute and lets them idle while they wait for the "
                                                          "wire, as a real rank's core (replay/awake.py)")
    neighbours: Literal["co_run", "stand_in"] = Field(
        "co_run", description="what computes beside a slice's loaded run: co_run, other slices of the job run "
                              "at once on the other cores (replay/slices.py); stand_in, a small MLP load on the "
                              "assistant's cores (launch/neighbour_load.py)")
    rules: list[str] = Field(default_factory=list, description="extra tensor rules, as module:function")
    dp_dedup: bool = Field(True, description="rules mode, built-in workloads: collect one DP replica and rename it "
                                             "to all; valid only when replicas run the same structure (not with "
                                             "learned MoE routing, whose sizes follow each replica's data)")
    tensor_cache: str | None = Field(None, description="rules mode: a tensors.zarr of an earlier context-switching "
                                                       "collection; ops it holds are answered from it")


_CRON_FIELD = r"[0-9A-Za-z*/,?#L-]+"


class ReportConfig(_Strict):
    schedule: str = Field("0 2 * * *", description="cron expression (five fields) of the nightly run `prism serve` registers; "
                                      "default 02:00 every day")
    max_iteration_time_change: float = Field(0.10, ge=0, description="a checked run (nightly) fails when a rank of "
                                             "interest's iteration time moved by more than this fraction from the "
                                             "previous version, either way (this machine's noise is ±5-10%)")
    max_peak_memory_change: float = Field(0.0, ge=0, description="likewise for peak memory (exact, so 0: any "
                                          "change of a byte fails)")

    @field_validator("schedule")
    @classmethod
    def _cron(cls, value: str) -> str:
        if not re.fullmatch(rf"{_CRON_FIELD}( {_CRON_FIELD}){{4}}", value.strip()):
            raise ValueError(f"{value!r} is not a cron expression of five fields (minute hour day month weekday), "
                             "e.g. '0 2 * * *' for 02:00 every day")
        return value.strip()


class PrismConfig(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]+$", description="job name, used in artifact paths")
    job: JobConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    emulation: EmulationConfig = Field(default_factory=EmulationConfig)
    report: ReportConfig = Field(default_factory=ReportConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> PrismConfig:
        problems = _job_problems(self)
        if self.job.is_builtin:
            problems += _layout_problems(self)
            if not problems:
                problems += _model_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _job_problems(cfg: PrismConfig) -> list[str]:
    job, emu = cfg.job, cfg.emulation
    out = []
    if job.is_builtin and job.program not in BUILTIN_PROGRAMS:
        out.append(f"job.program: unknown built-in {job.program!r}; use one of {', '.join(BUILTIN_PROGRAMS)} "
                   "or a path to a .py training script")
    if not job.is_builtin and not job.program.endswith(".py"):
        out.append(f"job.program: {job.program!r} is neither a built-in nor a .py script path")
    if job.iterations <= job.warmup:
        out.append(f"job.iterations: {job.iterations} steps leave none to measure after job.warmup={job.warmup}; "
                   f"set job.iterations to at least {job.warmup + 1}")
    bad = [r for r in emu.ranks_of_interest if not 0 <= r < job.world_size]
    if bad:
        out.append(f"emulation.ranks_of_interest: {bad} outside the world of {job.world_size} ranks "
                   f"(valid: 0..{job.world_size - 1})")
    if len(set(emu.ranks_of_interest)) != len(emu.ranks_of_interest):
        out.append("emulation.ranks_of_interest: lists a rank twice")
    if emu.sandbox > job.world_size:
        out.append(f"emulation.sandbox: {emu.sandbox} sandbox ranks exceed the world of {job.world_size} ranks")
    if not job.is_builtin:
        stray = sorted({"model", "parallel"} & cfg.model_fields_set)
        if stray:
            out.append(f"{stray[0]}: model and parallel settings only shape the built-in workloads; a script "
                       f"({job.program}) takes its own arguments through job.args — remove the {stray[0]} section")
    elif job.args:
        out.append("job.args: the built-in workload takes no arguments; set its model and parallel keys instead")
    if emu.sandbox > emu.slots:
        out.append(f"emulation.sandbox: {emu.sandbox} sandbox ranks do not fit on emulation.slots={emu.slots}; "
                   f"lower emulation.sandbox or raise emulation.slots")
    if emu.tensor_cache is not None and emu.collect_mode != "rules":
        out.append("emulation.tensor_cache: only rules-mode collection reads a tensor cache; "
                   "set emulation.collect_mode=rules or drop the key")
    return out


def _layout_problems(cfg: PrismConfig) -> list[str]:
    job, par = cfg.job, cfg.parallel
    w, tp, pp = job.world_size, par.tp, par.pp
    out = []
    if par.dp is None:
        if w % (tp * pp):
            out.append(f"job.world_size: {w} is not a multiple of parallel.tp × parallel.pp = {tp * pp}; "
                       f"world_size = tp × pp × dp, so use a multiple of {tp * pp}")
            return out
        par.dp = w // (tp * pp)
    elif tp * pp * par.dp != w:
        out.append(f"parallel.dp: tp × pp × dp = {tp}×{pp}×{par.dp} = {tp * pp * par.dp} but job.world_size = {w}; "
                   f"set job.world_size={tp * pp * par.dp}"
                   + (f" or parallel.dp={w // (tp * pp)}" if w % (tp * pp) == 0 else ""))
        return out
    if par.dp % par.ep:
        out.append(f"parallel.ep: ep={par.ep} must divide the data-parallel size dp={par.dp} (expert parallelism "
                   "is folded into the data-parallel ranks, expert-data-parallel size = dp / ep)")
    if par.vpp > 1 and pp == 1:
        out.append("parallel.vpp: virtual pipeline stages need parallel.pp > 1; set parallel.vpp=1")
    if par.vpp == 1 and pp > 1 and par.microbatches < pp:
        out.append(f"parallel.microbatches: the 1F1B schedule needs at least pp={pp} microbatches, "
                   f"got {par.microbatches}")
    if par.vpp > 1 and par.microbatches % pp:
        out.append(f"parallel.microbatches: the interleaved schedule needs a multiple of pp={pp} microbatches, "
                   f"got {par.microbatches}")
    return out


def _model_problems(cfg: PrismConfig) -> list[str]:
    m, par = cfg.model, cfg.parallel
    out = []
    chunks = par.pp * par.vpp
    if m.num_layers % chunks:
        out.append(f"model.num_layers: {m.num_layers} layers cannot be split into pp × vpp = {chunks} equal "
                   f"model chunks; use a multiple of {chunks}")
    if m.num_experts % par.ep:
        out.append(f"model.num_experts: {m.num_experts} experts cannot be split over parallel.ep={par.ep}; "
                   f"use a multiple of {par.ep}")
    if m.moe_router_topk > m.num_experts:
        out.append(f"model.moe_router_topk: top-{m.moe_router_topk} routing needs at least that many experts, "
                   f"model.num_experts={m.num_experts}")
    if m.head_dim is None and m.hidden_size % m.num_attention_heads:
        out.append(f"model.hidden_size: {m.hidden_size} is not divisible by model.num_attention_heads="
                   f"{m.num_attention_heads}; set model.head_dim explicitly or change either")
    elif m.kv_channels % 2:
        out.append(f"model.head_dim: rotary embeddings need an even head dimension, got {m.kv_channels}")
    if m.num_attention_heads % m.num_query_groups:
        out.append(f"model.num_query_groups: {m.num_query_groups} must divide model.num_attention_heads="
                   f"{m.num_attention_heads}")
    for field, value in (("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.num_query_groups),
                         ("vocab_size", m.vocab_size), ("moe_ffn_hidden_size", m.moe_ffn_hidden_size)):
        if value % par.tp:
            out.append(f"model.{field}: {value} is not divisible by parallel.tp={par.tp} (tensor parallelism "
                       f"shards it); use a multiple of {par.tp}")
    return out


# ----------------------------------------------------------------------------------------------
# Loading and overrides


def _field_annotation(model: type[BaseModel], dotted: str) -> Any:
    """The annotation of a dotted key, or ConfigError naming the unknown part."""
    current: Any = model
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            raise ConfigError(f"--set {dotted}: {'.'.join(parts[:i])} takes a value, not sub-keys")
        fields = current.model_fields
        if part not in fields:
            close = difflib.get_close_matches(part, list(fields), n=1)
            hint = f"; did you mean {'.'.join(parts[:i] + close)}?" if close else f"; known: {', '.join(fields)}"
            raise ConfigError(f"--set {dotted}: unknown key {'.'.join(parts[:i + 1])!r}{hint}")
        current = fields[part].annotation
    return current


def _is_list(annotation: Any) -> bool:
    if get_origin(annotation) is list:
        return True
    return any(_is_list(a) for a in get_args(annotation))


def _is_str(annotation: Any) -> bool:
    return annotation is str or any(_is_str(a) for a in get_args(annotation))


def parse_override(text: str) -> tuple[str, Any]:
    """Split `KEY=VALUE`, typing VALUE as YAML would (lists are comma-separated); text fields keep the raw text."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set parallel.pp=2")
    key, raw = text.split("=", 1)
    key = key.strip()
    annotation = _field_annotation(PrismConfig, key)
    typed = str if _is_str(annotation) else yaml.safe_load
    if _is_list(annotation):
        items = [s.strip() for s in raw.split(",") if s.strip()]
        return key, [typed(s) for s in items]
    return key, typed(raw.strip()) if raw.strip() else None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        key, value = parse_override(text)
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part} is not a section in the config file")
            node = child
        node[parts[-1]] = value
    return raw


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key (a typo?); remove it or fix its name"
        elif e["type"] == "missing":
            msg = "required and missing"
        lines.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid config {source}: " + "; ".join(lines)


def config_to_dict(cfg: PrismConfig) -> dict[str, Any]:
    """A JSON-ready dict that `config_from_dict` turns back into the same config (a script's config
    carries no model or parallel section)."""
    out = cfg.model_dump(mode="json")
    if not cfg.job.is_builtin:
        out.pop("model")
        out.pop("parallel")
    return out


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> PrismConfig:
    try:
        return PrismConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> PrismConfig:
    """Read a YAML config, apply `--set` overrides, validate; ConfigError on any problem."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as err:
        raise ConfigError(f"config file {path} cannot be read: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping with name, job, model, parallel, emulation")
    raw = apply_overrides(raw, overrides or [])
    cfg = config_from_dict(raw, str(path))
    if not cfg.job.is_builtin:
        cfg.job.program = str(_resolve_script(cfg.job.program, path))
    return cfg


def _resolve_script(program: str, config_path: Path) -> Path:
    for candidate in (Path(program), config_path.parent / program):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"job.program: script {program!r} not found (looked relative to the working "
                      f"directory and to {config_path.parent})")
