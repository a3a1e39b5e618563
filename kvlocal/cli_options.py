"""The command line's options, each declared once, and the option groups the commands share.

An option is a typer `Annotated` alias; its --help panel says who needs it: the everyday few (no
panel name), then ROUTING and PREFILL tuning, and the measuring commands' own (eval, bench, lab). A
command takes a group (`RouteOptions`, `PrefillOptions`) as one parameter; `option_groups` shows typer
the group's fields in its place and hands the command the group object, which turns into the core's
RouteConfig or PrefillConfig. A command gives an option its default; the list options (`--lengths`,
`--seeds`, `--budgets`, ...) are read by `ints`, `bounded` and `lengths` (UsageError naming the option).

Defaults and bounds come from route_settings (no numpy, ctypes or engine here, so --help stays fast);
a bound is checked by typer (exit 2, before any work) and again by the core.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvlocal.route_settings import (
    CENTROID_BLOCKS,
    DEFAULT_ATTENTION,
    DEFAULT_FOCUS,
    DEFAULT_CENTROID_BLOCK,
    DEFAULT_CENTROID_TYPE,
    DEFAULT_HINTS,
    DEFAULT_KEEP,
    DEFAULT_PIN,
    DEFAULT_FOLLOW,
    DEFAULT_PREFILL_FROM,
    DEFAULT_PREFILL_TOP_K,
    DEFAULT_PREFILL_UBATCH,
    DEFAULT_QUESTION,
    DEFAULT_QUESTION_TOP_K,
    DEFAULT_REGION,
    DEFAULT_SHORTLIST,
    DEFAULT_SINKS,
    DEFAULT_TOP_K,
    DEFAULT_WINDOW,
    LIBRARY_HINTS,
    LIBRARY_QUESTION,
    LIBRARY_TOP_K,
    MAX_ANSWER_TOKENS,
    MAX_CTX,
    MAX_REGION,
    MAX_SEED,
    MAX_SHORTLIST,
    MAX_SINKS,
    MAX_THREADS,
    MAX_TOP_K,
    MAX_WINDOW,
    MIN_CTX,
    SHORTLIST_AUTO,
)
from kvlocal.rpc import ENV_SERVERS

ROUTING = "Routing"  # --help panel of the decode route's tuning
PREFILL = "Prefill"  # --help panel of the routed prefill's tuning
LIBRARY = "Library"  # --help panel of the library sets' own options (eval library, lab hints)
DISTRIBUTED = "Distributed (RPC)"  # --help panel of the layers on llama.cpp RPC servers

# -- everyday -----------------------------------------------------------------------------------

ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", help="Model alias (see `kvlocal models`) or a GGUF file.")]
CtxOpt = Annotated[Optional[int], typer.Option(
    "--ctx", min=MIN_CTX, max=MAX_CTX, help="Context tokens (default: fit the document).")]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", "-t", min=1, max=MAX_THREADS, help="CPU threads (default: all cores).")]
KvTypeOpt = Annotated[str, typer.Option("--kv-type", help="KV cache type: f16 or q8_0.")]
MaxTokensOpt = Annotated[Optional[int], typer.Option(
    "--max-tokens", "-n", min=1, max=MAX_ANSWER_TOKENS, help="Most answer tokens (eval: by task unless given).")]
TemperatureOpt = Annotated[float, typer.Option("--temperature", help="0 answers greedily.")]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="Neither load nor save the document's KV state.")]
MaxKvOpt = Annotated[Optional[str], typer.Option(
    "--max-kv", metavar="SIZE", show_default="half the memory",
    help="Most KV cache a set of documents may take, e.g. 8GiB; a larger set is refused before loading.")]
RouteOpt = Annotated[str, typer.Option(
    "--route", help="geometric (routed), full (dense), or the controls window and random.")]
HaystackOpt = Annotated[Optional[Path], typer.Option(
    "--haystack", help="Plant the facts into this document's text instead of generated prose (each document of a "
    "library set starts it at another place).")]
OutOpt = Annotated[Optional[Path], typer.Option(
    "--out", help="Where the results go: a folder (eval, lab; a rerun resumes from it) or a JSON file (bench).")]

# -- the measuring commands: eval, bench, lab ------------------------------------------------------

MIN_EVAL_LENGTH = 2048  # room for the needles of 11 depths, the question and the answer
MAX_DEPTHS = 101  # needle depths (facts per haystack): one per percent

LengthsOpt = Annotated[str, typer.Option("--lengths", help="Context lengths, e.g. 8k,16k,32k (a library set: each document's).")]
DepthsOpt = Annotated[int, typer.Option(
    "--depths", min=2, max=MAX_DEPTHS, help="Facts per haystack, planted from 0% to 100% depth (the lab leaves out "
    "facts in the sinks or the window).")]
TasksOpt = Annotated[str, typer.Option("--tasks", help=(
    "Comma-separated. eval grid and the lab: "
    "passkey,multikey,lookalike,onekey,multivalue,multiquery,vartrack,cwe,manifest,tray; "
    "eval ruler: all, or niah_single_1..3, niah_multikey_1..3, niah_multivalue, niah_multiquery, vt, cwe, fwe, "
    "qa_1, qa_2."))]
SeedsOpt = Annotated[str, typer.Option("--seeds", help="Haystack seeds.")]
ModesOpt = Annotated[str, typer.Option("--modes", help="Routing modes to compare.")]
AlsoOpt = Annotated[str, typer.Option(
    "--also", help="More geometric routes asked on the same prefilled samples: the route given with some settings "
                   "changed, ';' between routes, ',' between settings (top-k, layer-top-k, keep, pin, follow, hints, region, "
                   "window, sinks, shortlist), e.g. 'keep=0;top-k=8,layer-top-k='.")]
SweepOpt = Annotated[str, typer.Option("--sweep", help="Extra geometric top-k budgets, e.g. 2,4,16.")]
PlotsOpt = Annotated[bool, typer.Option("--plots/--no-plots", help="Write PNG plots (needs matplotlib).")]
TokensOpt = Annotated[int, typer.Option("--tokens", min=1, max=MAX_ANSWER_TOKENS, help="Answer tokens timed per run.")]
UpkeepOpt = Annotated[bool, typer.Option("--upkeep/--no-upkeep", help="Also time prefill with and without centroid upkeep (4k).")]
TtftOpt = Annotated[bool, typer.Option(
    "--ttft/--no-ttft", help="Also time the first answer token of a 4k document, prefilled and from the cache.")]
ControlsOpt = Annotated[bool, typer.Option("--controls", help="Also time the window and random routes at the geometric route's budget.")]
PlainLoopOpt = Annotated[bool, typer.Option(
    "--plain-loop", help="Also time llama.cpp's own dense decoding loop on the same state (the reference for kvlocal's loop).")]
HereOpt = Annotated[bool, typer.Option(
    "--here/--no-here", rich_help_panel=DISTRIBUTED,
    help="With --rpc: first decode the same answers with every layer on this machine, for the cost of the servers "
         "in one run (this machine must hold the whole model and its KV cache then).")]
OtherAttentionOpt = Annotated[bool, typer.Option(
    "--other-attention", help="Also time the geometric route read by the other attention path than --attention's "
    "(in place, or gathered).")]
PrefillLengthsOpt = Annotated[str, typer.Option(
    "--prefill-lengths", rich_help_panel=PREFILL, help="Lengths prefilled from scratch (not from the cache), dense "
    "then routed; none: skip (a 32k document dense: 12-19 min on 2 cores, BENCHMARKS.md §10).")]
PrefillRoutedOpt = Annotated[bool, typer.Option(
    "--prefill-routed/--no-prefill-routed", rich_help_panel=PREFILL,
    help="Also prefill each --prefill-lengths document routed (--prefill routed) and compare; --no-prefill-routed "
         "times the dense prefill only (half the time).")]
RulesOpt = Annotated[str, typer.Option("--rules", help="Selection rules to replay (comma-separated), or 'all'.")]
BudgetsOpt = Annotated[str, typer.Option("--budgets", help="Regions selected per layer and KV head.")]
LayerBudgetOpt = Annotated[str, typer.Option(
    "--layer-budget", help="Scale the budget per layer, e.g. 2-11:2,14-27:0.5 (layers 2-11 read twice the regions, "
    "14-27 half); the reduction counts what each layer reads.")]
ChunksOpt = Annotated[str, typer.Option("--chunks", help="Tokens per selection (the routed ubatch size), e.g. 512,128.")]
EstimatesOpt = Annotated[bool, typer.Option(
    "--estimates", help="Also score every rule with the unread regions joining the attention as their mean keys and "
    "values (per region, per centroid block, and per block with the keys' variance).")]

# a library set's own (eval library, bench library, lab hints)
LibrarySizesArg = Annotated[str, typer.Argument(
    metavar="N[,N...]", help="Sets of N documents each (e.g. 4 or 4,16), each document of --lengths tokens: look-alike "
    "facts spread over the documents of a set, loaded as one cache.")]
QuestionFileArg = Annotated[Path, typer.Argument(
    metavar="FILE", help="A question file (JSON): real documents by path and sha256, and questions written by hand "
    "with the words each answer must hold (kvlocal/evals/question_sets.py; one ships in kvlocal/evals/question_files/).")]
ParaphraseOpt = Annotated[bool, typer.Option(
    "--paraphrase", rich_help_panel=LIBRARY,
    help="Ask each fact in other words (the key word kept, the rest reworded); the documents, and their cached "
         "states, stay the same.")]
SetsPerSeedOpt = Annotated[int, typer.Option(
    "--sets-per-seed", rich_help_panel=LIBRARY, min=1, max=40, help="Disjoint sets drawn from each seed's documents "
    "(the same fact sentence; more facts per seed without more seeds' shapes).")]
FactsPerDocOpt = Annotated[int, typer.Option(
    "--facts-per-doc", rich_help_panel=LIBRARY, min=1, max=8, help="Facts planted in each document of a set.")]
ReferencesOpt = Annotated[str, typer.Option(
    "--references", rich_help_panel=LIBRARY, help="What else the facts are asked of: alone (each fact of its own "
    "document, from its cached state), concat (the set prefilled as one document, where it fits the trained context; "
    "32k: ~30 min on 2 cores), none.")]
AloneModesOpt = Annotated[str, typer.Option(
    "--alone-modes", rich_help_panel=LIBRARY, help="The modes each fact is asked of its document alone in "
    "(--references alone), e.g. full,geometric.")]
LayoutOpt = Annotated[str, typer.Option(
    "--layout", rich_help_panel=LIBRARY, help="A set's positions: auto (consecutive while the set fits the trained "
    "context, else parallel), consecutive or parallel.")]
SetSeedOpt = Annotated[int, typer.Option(
    "--set-seed", min=0, max=MAX_SEED, rich_help_panel=LIBRARY, help="The seed of the sets' documents (as `kvlocal "
    "eval library --seeds`: a set evaluated there opens from the cache).")]
HintScopeOpt = Annotated[str, typer.Option(
    "--hint-scope", rich_help_panel=LIBRARY, help="What scores a hinted place: sentence (the question words within "
    "reach of it, what `kvlocal ask` uses), region (the words of its whole region, the earlier rule), or both.")]


def ints(text: str) -> list[int]:
    """A comma-separated list of numbers, 8k meaning 8192."""
    from kvlocal.errors import UsageError

    try:
        return [int(x.replace("k", "")) * (1024 if x.endswith("k") else 1) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"expected a comma-separated list of numbers, got {text!r}") from None


def bounded(option: str, values: list[int], low: int, high: int) -> list[int]:
    """A list option's values, each checked before any work (UsageError naming the option)."""
    from kvlocal.errors import UsageError

    bad = [v for v in values if not low <= v <= high]
    if bad:
        raise UsageError(f"{option}: {', '.join(map(str, bad))} not between {low} and {high:,}")
    return values


def lengths(text: str) -> list[int]:
    """--lengths: context lengths of at least MIN_EVAL_LENGTH (the model's trained context is checked later)."""
    from kvlocal.errors import UsageError

    values = ints(text)
    if not values:
        raise UsageError("--lengths names no context length")
    short = [n for n in values if n < MIN_EVAL_LENGTH]
    if short:
        raise UsageError(f"context lengths must be at least 2k (the haystack needs room for its needles, "
                         f"the question and the answer), got {', '.join(map(str, short))}")
    return bounded("--lengths", values, MIN_EVAL_LENGTH, MAX_CTX)


def seeds(text: str) -> list[int]:
    """--seeds: at least one."""
    from kvlocal.errors import UsageError

    values = ints(text)
    if not values:
        raise UsageError("--seeds names no seed")
    return values


# -- routing and prefill tuning: each alias once, then the groups whose fields they are ---------

SeedOpt = Annotated[int, typer.Option(
    "--seed", min=0, max=MAX_SEED, rich_help_panel=ROUTING, help="Seed of sampling and of the random route.")]
PrefillOpt = Annotated[str, typer.Option(
    "--prefill", rich_help_panel=PREFILL, help="dense, or routed: from --prefill-from on, each ubatch reads only "
    "the regions its queries choose (faster only for long documents, may lose facts; its saved state is kept apart).")]


def _shortlist_value(text: str) -> int:
    """--shortlist: a number of regions, or auto (SHORTLIST_AUTO)."""
    if isinstance(text, int):  # the default
        return text
    if text.strip().lower() == "auto":
        return SHORTLIST_AUTO
    try:
        value = int(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is neither a number of regions nor auto") from None
    if not 0 <= value <= MAX_SHORTLIST:
        raise typer.BadParameter(f"{value} is not between 0 and {MAX_SHORTLIST:,}")
    return value


TopKOpt = Annotated[Optional[int], typer.Option(
    "--top-k", min=0, max=MAX_TOP_K, rich_help_panel=ROUTING,
    show_default=f"the model's route, else {DEFAULT_TOP_K}; a set read whole: {LIBRARY_TOP_K}",
    help="Regions each step reads per layer and KV head, besides the sinks and the window. A model with a "
    "calibrated route (the default model; `kvlocal models` shows it) reads its own budget unless --top-k or "
    "--layer-top-k is given. A set of several documents read whole (--focus set) answers with its own route "
    "(--top-k 1 --hints 1 --question-pass steps) unless one of those three is given.")]
RegionOpt = Annotated[int, typer.Option(
    "--region", min=1, max=MAX_REGION, rich_help_panel=ROUTING, help=f"Tokens per region: a power of two up to {MAX_REGION}.")]
WindowOpt = Annotated[int, typer.Option(
    "--window", min=0, max=MAX_WINDOW, rich_help_panel=ROUTING, help="Recent tokens always read.")]
SinksOpt = Annotated[int, typer.Option(
    "--sinks", min=0, max=MAX_SINKS, rich_help_panel=ROUTING, help="First tokens always read.")]
ShortlistOpt = Annotated[int, typer.Option(
    "--shortlist", parser=_shortlist_value, metavar="N|auto", rich_help_panel=ROUTING,
    show_default="auto" if DEFAULT_SHORTLIST == SHORTLIST_AUTO else str(DEFAULT_SHORTLIST),
    help="Regions a coarse pass shortlists for the fine centroids to choose from; auto: an eighth of the "
    "document's (at least the floor of the model's route); 0: one pass over every fine centroid.")]
KeepOpt = Annotated[float, typer.Option(
    "--keep", min=0.0, max=0.999, rich_help_panel=ROUTING,
    help="Share of its last score a region keeps at the next step (0: choose afresh).")]
PinOpt = Annotated[int, typer.Option(
    "--pin", min=0, max=MAX_TOP_K, rich_help_panel=ROUTING,
    help="Regions of --top-k the dense question pass keeps read for the whole answer.")]
FollowOpt = Annotated[int, typer.Option(
    "--follow", min=0, max=MAX_TOP_K, rich_help_panel=ROUTING,
    help="First choices of a step (the pins first) whose next region it also reads, so that a value copied "
    "out of a region's end goes on in the next (with --keep; each layer reads this many more regions).")]
HintsOpt = Annotated[Optional[int], typer.Option(
    "--hints", min=0, max=MAX_TOP_K, rich_help_panel=ROUTING, show_default=f"{DEFAULT_HINTS}; a set read whole: {LIBRARY_HINTS}",
    help="Places of the question's rarest words whose regions are read in place of --top-k choices (geometric "
    "routing; 0: none): the word's region, and the next where its sentence runs on (top-k is raised to fit). "
    "Helps facts that differ from their look-alikes in one word; with --top-k 1 --question-pass steps a step "
    "reads the hinted sentence and nothing else beside the sinks and window.")]
FocusOpt = Annotated[str, typer.Option(
    "--focus", rich_help_panel=ROUTING, case_sensitive=False,
    help="What an answer about a set of documents reads: hinted (only the document that holds the question's "
    "rarest words, routed as that document alone would be: the other documents are not seen) or set (every "
    "document, with the set's own route). A question whose words hint nowhere reads the set.")]
LayerTopKOpt = Annotated[Optional[str], typer.Option(
    "--layer-top-k", metavar="LAYERS=K,...", rich_help_panel=ROUTING, show_default="the model's route, else none",
    help="Regions some layers read per step instead of --top-k, e.g. 16-23=8 (layers 16 to 23 read 8, the "
    "others --top-k); the controls read as many per layer. '' gives every layer --top-k.")]
CentroidBlockOpt = Annotated[int, typer.Option(
    "--centroid-block", min=0, max=max(CENTROID_BLOCKS), rich_help_panel=ROUTING,
    help="Tokens per key centroid (0: none, every step reads densely).")]
CentroidTypeOpt = Annotated[Optional[str], typer.Option(
    "--centroid-type", rich_help_panel=ROUTING, show_default=f"the model's route, else {DEFAULT_CENTROID_TYPE}",
    help="Type of the key centroids: f16, or q8_0 (about half the bytes).")]
QuestionPassOpt = Annotated[Optional[str], typer.Option(
    "--question-pass", rich_help_panel=ROUTING, show_default=f"{DEFAULT_QUESTION}; a set read whole: {LIBRARY_QUESTION}",
    help="How the question reads the document: dense (once, all of it), routed (once, --question-top-k "
    "regions) or steps (token by token, like the answer).")]
AttentionOpt = Annotated[str, typer.Option(
    "--attention", rich_help_panel=ROUTING, case_sensitive=False,
    help="How a routed step reads its regions: gather (copy the selected rows, then attend), in-place (attend to "
    "the cache under a mask of the selected cells, read sparsely by CUDA's kernel) or auto (in place on a CUDA GPU, "
    "gathered elsewhere).")]
QuestionTopKOpt = Annotated[int, typer.Option(
    "--question-top-k", min=0, max=MAX_TOP_K, rich_help_panel=ROUTING, help="Regions a routed question pass reads.")]
PrefillTopKOpt = Annotated[int, typer.Option(
    "--prefill-top-k", min=1, max=MAX_TOP_K, rich_help_panel=PREFILL,
    help="Regions a routed ubatch reads per layer and KV head (fewer: faster, more facts lost).")]
PrefillFromOpt = Annotated[int, typer.Option(
    "--prefill-from", min=0, max=MAX_CTX, rich_help_panel=PREFILL,
    help="Tokens prefilled densely before a routed prefill starts routing.")]
PrefillUbatchOpt = Annotated[int, typer.Option(
    "--prefill-ubatch", min=1, max=MAX_CTX, rich_help_panel=PREFILL,
    help="Tokens per routed ubatch (at most 512); its queries choose one set of regions.")]


@dataclass(frozen=True)
class RouteOptions:
    """The decode route's tuning and the key centroids it scores regions by (the session keeps them)."""

    top_k: TopKOpt = None  # None: the model's route, or the library route's on a set read whole (with hints and question_pass)
    region: RegionOpt = DEFAULT_REGION
    window: WindowOpt = DEFAULT_WINDOW
    sinks: SinksOpt = DEFAULT_SINKS
    shortlist: ShortlistOpt = DEFAULT_SHORTLIST
    keep: KeepOpt = DEFAULT_KEEP
    pin: PinOpt = DEFAULT_PIN
    follow: FollowOpt = DEFAULT_FOLLOW
    hints: HintsOpt = None
    layer_top_k: LayerTopKOpt = None  # None: the model's route
    centroid_block: CentroidBlockOpt = DEFAULT_CENTROID_BLOCK
    centroid_type: CentroidTypeOpt = None  # None: the model's route
    question_pass: QuestionPassOpt = None
    question_top_k: QuestionTopKOpt = DEFAULT_QUESTION_TOP_K
    attention: AttentionOpt = DEFAULT_ATTENTION
    focus: FocusOpt = DEFAULT_FOCUS

    def config(self, mode: str, seed: int = 0):
        """The core's RouteConfig of `mode` with these settings, an option not given left None (the
        model's route and the documents decide it: kvlocal.routing.resolve_route); UsageError (exit 2)
        unless the engine can follow them with these centroids."""
        from kvlocal.routing import RouteConfig, check_centroid_type, check_region_block

        route = RouteConfig(mode=mode, region=self.region, top_k=self.top_k, window=self.window, sinks=self.sinks,
                            seed=seed, shortlist=self.shortlist, keep=self.keep, question=self.question_pass,
                            question_top_k=self.question_top_k, pin=self.pin, follow=self.follow, hints=self.hints,
                            layer_top_k=self.layer_top_k, attention=self.attention.lower(), focus=self.focus.lower())
        check_region_block(self.region, self.centroid_block)
        if self.centroid_type is not None:
            check_centroid_type(self.centroid_type)
        return route


@dataclass(frozen=True)
class PrefillOptions:
    """How a routed prefill reads the document (the mode, --prefill, is a command's own choice)."""

    prefill_top_k: PrefillTopKOpt = DEFAULT_PREFILL_TOP_K
    prefill_from: PrefillFromOpt = DEFAULT_PREFILL_FROM
    prefill_ubatch: PrefillUbatchOpt = DEFAULT_PREFILL_UBATCH

    def config(self, mode: str):
        """The core's PrefillConfig of `mode` (dense or routed) with these settings."""
        from kvlocal.routing import PrefillConfig

        return PrefillConfig(mode=mode, top_k=self.prefill_top_k, start=self.prefill_from, ubatch=self.prefill_ubatch)


@dataclass(frozen=True)
class LabOptions:
    """The haystacks a lab run captures (as `kvlocal eval` plants them), the rules it replays and their
    budgets, and the region geometry (lab decode, lab prefill)."""

    lengths: LengthsOpt = "8k"
    tasks: TasksOpt = "lookalike"
    depths: DepthsOpt = 10
    seeds: SeedsOpt = "0"
    rules: RulesOpt = "all"
    budgets: BudgetsOpt = "8"
    out: OutOpt = Path("kvlocal-lab")
    haystack: HaystackOpt = None
    region: RegionOpt = DEFAULT_REGION
    window: WindowOpt = DEFAULT_WINDOW
    sinks: SinksOpt = DEFAULT_SINKS


# -- past one machine: llama.cpp's RPC servers (kvlocal.rpc) ---------------------------------------

RpcOpt = Annotated[Optional[str], typer.Option(
    "--rpc", envvar=ENV_SERVERS, metavar="HOST:PORT[,...]", rich_help_panel=DISTRIBUTED,
    help="llama.cpp RPC servers (`kvlocal rpc-server` on each machine) to hold some of the model's layers and "
         "their KV cache; this machine holds the first layers. The protocol has no authentication: trusted "
         f"networks only. Default: ${ENV_SERVERS}.")]
TensorSplitOpt = Annotated[Optional[str], typer.Option(
    "--tensor-split", metavar="HERE,S1[,S2...]", rich_help_panel=DISTRIBUTED, show_default="equal shares",
    help="With --rpc: each machine's share of the layers (this one, then each server in --rpc's order), e.g. "
         "1,2,2; the model's layers and its output layer are split in these proportions.")]

RpcHostOpt = Annotated[str, typer.Option(
    "--host", help="Address to listen on: loopback unless --allow-remote.")]
RpcPortOpt = Annotated[int, typer.Option("--port", "-p", min=1, max=65535, help="Port to listen on.")]
RpcMemOpt = Annotated[Optional[str], typer.Option(
    "--mem", metavar="SIZE", show_default="no cap",
    help="Most memory the server may allocate, e.g. 24GiB (its data segment, RLIMIT_DATA): a client whose layers "
         "need more fails to load with an error. Clients split layers by --tensor-split, not by this.")]
AllowRemoteOpt = Annotated[bool, typer.Option(
    "--allow-remote", help="Listen on a non-loopback address (the protocol has no authentication: anyone who "
                           "reaches the port can use this machine; trusted networks only).")]


@dataclass(frozen=True)
class RpcOptions:
    """Where the model's layers (and their KV cache) go: here, or split with RPC servers."""

    rpc: RpcOpt = None
    tensor_split: TensorSplitOpt = None

    def config(self):
        """The core's Placement (None: every layer on this machine); UsageError on a bad list."""
        from kvlocal.rpc import placement

        return placement(self.rpc, self.tensor_split)


OPTION_GROUPS = (RouteOptions, PrefillOptions, LabOptions, RpcOptions)


def option_groups(command):
    """Command decorator: a parameter annotated with an option group (e.g. `routing: RouteOptions =
    RouteOptions()`) is shown to typer as the group's fields, in its place; the command is called
    with the group object built from them."""
    signature = inspect.signature(command, eval_str=True)
    params: list[inspect.Parameter] = []
    groups: dict[str, tuple[type, list[str]]] = {}  # parameter -> (group, its field names)
    for param in signature.parameters.values():
        if param.annotation not in OPTION_GROUPS:
            params.append(param)
            continue
        group = param.annotation
        hints = inspect.get_annotations(group, eval_str=True)
        fields = dataclasses.fields(group)
        groups[param.name] = (group, [f.name for f in fields])
        params += [inspect.Parameter(f.name, param.kind, annotation=hints[f.name], default=f.default) for f in fields]
    names = [p.name for p in params]
    assert len(names) == len(set(names)), f"{command.__name__}: a group's field shadows a parameter"

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        for name, (group, fields) in groups.items():
            kwargs[name] = group(**{f: kwargs.pop(f) for f in fields if f in kwargs})
        return command(*args, **kwargs)

    wrapper.__signature__ = signature.replace(parameters=params)
    wrapper.__annotations__ = {p.name: p.annotation for p in params}  # typer reads these as type hints
    return wrapper
