"""llama-server's flag allow-list (protocol/engine_flags.py says how it is read)."""

from __future__ import annotations

import re

from protocol.flag_shapes import (
    ALIAS_RE,
    CONTAINER_ANY,
    LOOPBACK,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    SWITCH,
    EngineFlags,
    Flag,
    FloatRange,
    IntRange,
    Pattern,
    Shape,
    Words,
)
from protocol.flag_shapes import op as _op

# -- llama.cpp 0.6 -----------------------------------------------------------------------

_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")

# llama-server's own list (printed under --chat-template in --help); any other value
# of --chat-template is read as a Jinja template text.
_LLAMACPP_06_TEMPLATES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml",
    "command-r", "deepseek", "deepseek-ocr", "deepseek2", "deepseek3", "exaone-moe",
    "exaone3", "exaone4", "falcon3", "gemma", "gigachat", "glmedge", "gpt-oss",
    "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe",
    "hunyuan-vl", "kimi-k2", "llama2", "llama2-sys", "llama2-sys-bos",
    "llama2-sys-strip", "llama3", "llama4", "megrez", "minicpm", "mistral-v1",
    "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "monarch",
    "openchat", "orion", "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss",
    "smolvlm", "solar-open", "vicuna", "vicuna-orca", "yandex", "zephyr",
)  # fmt: skip

# The engine's environment: a few tuning switches, nothing that names a file, a
# library or a flag (llama-server reads LLAMA_ARG_* as flags; the loader, LD_*).
# ggml tests the two CUDA switches for being set at all, so their one value is "1".
_LLAMACPP_06_ENV: tuple[tuple[str, Shape], ...] = (
    ("OMP_NUM_THREADS", IntRange(1, 1024)),
    ("GGML_CUDA_NO_PINNED", Words(("1",))),
    ("GGML_CUDA_ENABLE_UNIFIED_MEMORY", Words(("1",))),
)

# Where the master's builder puts them (typed settings and the system's own flags).
_LLAMACPP_06_SYSTEM = (
    Flag(("-m", "--model"), Words((MODEL_PLACEHOLDER,)),
         why=f"the model is always '{MODEL_PLACEHOLDER}', the file the agent resolved"),
    Flag(("-a", "--alias"), Pattern(ALIAS_RE, "a served name (letters, digits, . _ : / @ + -)")),
    Flag(("-c", "--ctx-size"), IntRange(16, 1_073_741_824)),
    Flag(("-np", "--parallel"), IntRange(1, 256)),
    Flag(("-ngl", "--gpu-layers", "--n-gpu-layers"), IntRange(0, 999)),
    Flag(("-fa", "--flash-attn"), Words(("on", "off", "auto"))),
    Flag(("-ctk", "--cache-type-k"), Words(_KV_TYPES)),
    Flag(("-ctv", "--cache-type-v"), Words(_KV_TYPES)),
    Flag(("-b", "--batch-size"), IntRange(1, 1_048_576)),
    Flag(("-ub", "--ubatch-size"), IntRange(1, 1_048_576)),
    Flag(("--embedding", "--embeddings"), SWITCH),
    Flag(("--pooling",), Words(("none", "mean", "cls", "last", "rank"))),
    Flag(("--chat-template",), Words(_LLAMACPP_06_TEMPLATES),
         why="must be one of llama-server's built-in templates (a template text is refused)"),
    Flag(("-sm", "--split-mode"), Words(("none", "layer", "row", "tensor"))),
    Flag(("-dev", "--device"),
         Pattern(re.compile(r"CUDA[0-9]{1,2}(?:,CUDA[0-9]{1,2}){0,15}"), "CUDA0[,CUDA1...]")),
    Flag(("-ts", "--tensor-split"),
         Pattern(re.compile(r"[0-9]{1,9}(?:,[0-9]{1,9}){0,15}"), "whole numbers joined by ','")),
    Flag(("-rea", "--reasoning"), Words(("on", "off", "auto"))),
    Flag(("-t", "--threads"), IntRange(1, 1024)),
    # Which of the two depends on the delivery: check_engine_argv checks the pair.
    Flag(("--host",), Words((LOOPBACK, CONTAINER_ANY)),
         why=f"engines listen on {LOOPBACK} (a process) or {CONTAINER_ANY} (in a container)"),
    Flag(("--port",), Words((PORT_PLACEHOLDER,)),
         why=f"the only allowed form is '--port {PORT_PLACEHOLDER}' (the agent picks the port)"),
    Flag(("--metrics",), SWITCH),
    Flag(("--no-ui", "--no-webui"), SWITCH),
    Flag(("-cram", "--cache-ram"), IntRange(0, 0),
         why="the prompt cache in RAM stays off (admission does not count it)"),
    Flag(("-fit", "--fit"), Words(("off",)),
         why="fitting stays off (admission computed the budget from the settings)"),
)  # fmt: skip


# What an operator may add in extra_args: sampling defaults, rope/yarn numbers and
# performance switches. Nothing that takes a path, a URL, JSON, a directory or text,
# and nothing that enables tools, agents, MCP, props, slots, CORS or the web UI.
_LLAMACPP_06_OPERATOR = (
    _op(("--temp", "--temperature"), FloatRange(0, 10)),
    _op(("--top-k",), IntRange(0, 1_000_000)),
    _op(("--top-p",), FloatRange(0, 1)),
    _op(("--min-p",), FloatRange(0, 1)),
    _op(("--typical", "--typical-p"), FloatRange(0, 1)),
    _op(("--top-nsigma", "--top-n-sigma"), FloatRange(-1, 100)),
    _op(("--xtc-probability",), FloatRange(0, 1)),
    _op(("--xtc-threshold",), FloatRange(0, 1)),
    _op(("--repeat-penalty",), FloatRange(0, 10)),
    _op(("--repeat-last-n",), IntRange(-1, 4_194_304)),
    _op(("--presence-penalty",), FloatRange(-2, 2)),
    _op(("--frequency-penalty",), FloatRange(-2, 2)),
    _op(("--dry-multiplier",), FloatRange(0, 10)),
    _op(("--dry-base",), FloatRange(0, 10)),
    _op(("--dry-allowed-length",), IntRange(0, 65_536)),
    _op(("--dry-penalty-last-n",), IntRange(-1, 4_194_304)),
    _op(("--dynatemp-range",), FloatRange(0, 10)),
    _op(("--dynatemp-exp",), FloatRange(0, 10)),
    _op(("--mirostat",), IntRange(0, 2)),
    _op(("--mirostat-lr",), FloatRange(0, 1)),
    _op(("--mirostat-ent",), FloatRange(0, 100)),
    _op(("-s", "--seed"), IntRange(-1, 4_294_967_295)),
    _op(("-n", "--predict", "--n-predict"), IntRange(-1, 4_194_304)),
    _op(("--keep",), IntRange(-1, 4_194_304)),
    _op(("--ignore-eos",), SWITCH),
    _op(("--rope-scaling",), Words(("none", "linear", "yarn"))),
    _op(("--rope-scale",), FloatRange(0.01, 1024)),
    _op(("--rope-freq-base",), FloatRange(0, 1_000_000_000)),
    _op(("--rope-freq-scale",), FloatRange(0, 1024)),
    _op(("--yarn-orig-ctx",), IntRange(0, 4_194_304)),
    _op(("--yarn-ext-factor",), FloatRange(-1, 100)),
    _op(("--yarn-attn-factor",), FloatRange(-1, 100)),
    _op(("--yarn-beta-slow",), FloatRange(-1, 1000)),
    _op(("--yarn-beta-fast",), FloatRange(-1, 1000)),
    _op(("-lm", "--load-mode"), Words(("auto", "none", "mmap", "mlock", "mmap+mlock", "dio"))),
    _op(("--numa",), Words(("distribute", "isolate", "numactl"))),
    _op(("-tb", "--threads-batch"), IntRange(1, 1024)),
    _op(("-cb", "--cont-batching"), SWITCH),
    _op(("-nocb", "--no-cont-batching"), SWITCH),
    _op(("--cache-prompt",), SWITCH),
    _op(("--no-cache-prompt",), SWITCH),
    _op(("--cache-reuse",), IntRange(0, 1_048_576)),
    _op(("-dt", "--defrag-thold"), FloatRange(-1, 1)),
    _op(("--swa-full",), SWITCH),
    _op(("--context-shift",), SWITCH),
    _op(("--no-context-shift",), SWITCH),
    _op(("--warmup",), SWITCH),
    _op(("--no-warmup",), SWITCH),
    _op(("--jinja",), SWITCH),
    _op(("--no-jinja",), SWITCH),
    _op(("--reasoning-format",), Words(("none", "auto", "deepseek", "deepseek-legacy"))),
    _op(("--reasoning-budget",), IntRange(-1, 4_194_304)),
    _op(("--reasoning-effort",),
        Words(("default", "minimal", "low", "medium", "high", "xhigh", "max"))),
    _op(("-cmoe", "--cpu-moe"), SWITCH),
    _op(("-ncmoe", "--n-cpu-moe"), IntRange(0, 999)),
    _op(("-kvo", "--kv-offload"), SWITCH),
    _op(("-nkvo", "--no-kv-offload"), SWITCH),
    _op(("-sps", "--slot-prompt-similarity"), FloatRange(0, 1)),
    _op(("-to", "--timeout"), IntRange(1, 86_400)),
    _op(("--threads-http",), IntRange(-1, 1024)),
)  # fmt: skip

LLAMACPP_06 = EngineFlags(
    engine="llamacpp",
    label="llama.cpp 0.6",
    first=(0, 6),
    last=(0, 6),
    flags=_LLAMACPP_06_SYSTEM + _LLAMACPP_06_OPERATOR,
    chat_templates=_LLAMACPP_06_TEMPLATES,
    env=_LLAMACPP_06_ENV,
)
