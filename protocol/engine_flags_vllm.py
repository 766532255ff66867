"""vLLM's flag allow-list (protocol/engine_flags.py says how it is read)."""

from __future__ import annotations

import re

from protocol.flag_shapes import (
    ALIAS_RE,
    CONTAINER_ANY,
    MODEL_PLACEHOLDER,
    PORT_PLACEHOLDER,
    SWITCH,
    EngineFlags,
    Flag,
    FloatRange,
    FolderFile,
    IntRange,
    Pattern,
    Required,
    Shape,
    Words,
)
from protocol.flag_shapes import op as _op

# -- vLLM 0.x ----------------------------------------------------------------------------
#
# vLLM runs only in a container, from the vllm/vllm-openai image whose entrypoint is
# `vllm serve`: the argv is what follows it, the model first (a positional argument),
# then flags. vLLM's parser also reads --flag=VALUE, "_" for "-" and any unambiguous
# prefix of a long flag; the check reads none of these, so none gets past the list.

_VLLM_SAFE_FILE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}"

# The common --quantization methods for GPU checkpoints; experimental and other
# platforms' methods stay out until someone reviews them.
_VLLM_QUANTIZATION = (
    "awq", "awq_marlin", "gptq", "gptq_marlin", "gptq_marlin_24", "fp8", "ptpc_fp8",
    "fbgemm_fp8", "bitsandbytes", "compressed-tensors", "gguf", "marlin", "modelopt",
    "modelopt_fp4", "experts_int8", "moe_wna16", "mxfp4",
)  # fmt: skip

# vLLM's built-in parsers (a name it does not know fails at start with its own
# message); a plugin parser would be a Python file, so --tool-parser-plugin is not listed.
_VLLM_TOOL_PARSERS = (
    "deepseek_v3", "deepseek_v31", "ernie45", "glm45", "granite", "granite-20b-fc",
    "hermes", "hunyuan_a13b", "internlm", "jamba", "kimi_k2", "llama3_json",
    "llama4_json", "llama4_pythonic", "longcat", "minimax", "minimax_m2", "mistral",
    "olmo3", "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml",
    "seed_oss", "step3", "xlam",
)  # fmt: skip

_VLLM_REASONING_PARSERS = (
    "deepseek_r1", "deepseek_v3", "ernie45", "glm45", "granite", "hunyuan_a13b",
    "kimi_k2", "minimax_m2", "minimax_m2_append_think", "mistral", "olmo3",
    "openai_gptoss", "qwen3", "seed_oss", "step3",
)  # fmt: skip

_VLLM_ATTENTION_BACKENDS = (
    "FLASH_ATTN", "FLASHINFER", "XFORMERS", "TORCH_SDPA", "TRITON_ATTN",
    "FLEX_ATTENTION", "FLASHMLA", "TRITON_MLA", "CUTLASS_MLA",
)  # fmt: skip

# A few tuning variables; nothing that names a file, a URL, a plugin or a cache
# directory. VLLM_API_KEY is the agent's own (the engine's key), never a launch's.
_VLLM_ENV: tuple[tuple[str, Shape], ...] = (
    ("VLLM_ATTENTION_BACKEND", Words(_VLLM_ATTENTION_BACKENDS)),
    ("VLLM_USE_V1", Words(("0", "1"))),
    ("VLLM_LOGGING_LEVEL", Words(("DEBUG", "INFO", "WARNING", "ERROR"))),
    ("NCCL_P2P_DISABLE", Words(("0", "1"))),
    ("OMP_NUM_THREADS", IntRange(1, 1024)),
)

_VLLM_REQUIRED: Required = (
    ("--port", f"--port {PORT_PLACEHOLDER}", "the agent picks the port"),
    ("--served-model-name", "--served-model-name NAME",
     "the Ready check looks for it in /v1/models"),
)  # fmt: skip

# Where the master's builder puts them (models_registry/vllm.py, from typed settings).
# Admission reserves gpu_memory_utilization of each placed GPU, so the flags that
# size vLLM's memory are typed settings only.
_VLLM_SYSTEM = (
    # vLLM takes several names here; a second one is a token without a flag, refused.
    Flag(("--served-model-name",),
         Pattern(ALIAS_RE, "a served name (letters, digits, . _ : / @ + -)")),
    Flag(("--host",), Words((CONTAINER_ANY,)),
         why=f"vLLM runs in a container and listens on {CONTAINER_ANY} there (the agent "
             "publishes the port on the node's loopback only)"),
    Flag(("--port",), Words((PORT_PLACEHOLDER,)),
         why=f"the only allowed form is '--port {PORT_PLACEHOLDER}' (the agent picks the port)"),
    Flag(("--max-model-len",), IntRange(16, 16_777_216), setting="max_model_len"),
    Flag(("--max-num-seqs",), IntRange(1, 4096), setting="max_num_seqs"),
    Flag(("--gpu-memory-utilization",), FloatRange(0.05, 0.98),
         setting="gpu_memory_utilization"),
    Flag(("-tp", "--tensor-parallel-size"), IntRange(1, 16), setting="tensor_parallel_size"),
    Flag(("--dtype",), Words(("auto", "half", "float16", "bfloat16", "float", "float32")),
         setting="dtype"),
    Flag(("-q", "--quantization"), Words(_VLLM_QUANTIZATION), setting="quantization"),
    Flag(("--kv-cache-dtype",), Words(("auto", "fp8", "fp8_e4m3", "fp8_e5m2")),
         setting="kv_cache_dtype"),
    Flag(("--enable-prefix-caching",), SWITCH, setting="enable_prefix_caching"),
    Flag(("--no-enable-prefix-caching",), SWITCH, setting="enable_prefix_caching"),
    Flag(("--enable-auto-tool-choice",), SWITCH, setting="tool_call_parser"),
    Flag(("--tool-call-parser",), Words(_VLLM_TOOL_PARSERS), setting="tool_call_parser"),
    Flag(("--reasoning-parser",), Words(_VLLM_REASONING_PARSERS),
         setting="reasoning_parser"),
    # vLLM reads any other value as a path to open, or as the template text itself.
    Flag(("--chat-template",),
         FolderFile(
             re.compile(re.escape(MODEL_PLACEHOLDER) + "/" + _VLLM_SAFE_FILE + r"\.jinja"),
             f"'{MODEL_PLACEHOLDER}/NAME.jinja', a file in the model folder"),
         why=f"the only allowed form is '{MODEL_PLACEHOLDER}/NAME.jinja', a file in the "
             "model's read-only folder (another path or a template text is refused)",
         setting="chat_template"),
)  # fmt: skip

# What an operator may add in extra_args: serving and scheduling knobs that do not
# change what admission reserves (vLLM keeps to gpu_memory_utilization whatever they
# are). Nothing that takes a path, a URL, JSON or text, and not --trust-remote-code
# (it runs Python from the model folder).
_VLLM_OPERATOR = (
    _op(("--seed",), IntRange(0, 4_294_967_295)),
    _op(("--max-num-batched-tokens",), IntRange(1, 16_777_216)),
    _op(("--enable-chunked-prefill",), SWITCH),
    _op(("--no-enable-chunked-prefill",), SWITCH),
    _op(("--max-logprobs",), IntRange(0, 100_000)),
    _op(("--disable-sliding-window",), SWITCH),
    _op(("--enforce-eager",), SWITCH),
    _op(("--disable-custom-all-reduce",), SWITCH),
    _op(("--max-seq-len-to-capture",), IntRange(1, 16_777_216)),
    _op(("--block-size",), Words(("8", "16", "32", "64", "128"))),
    _op(("--scheduling-policy",), Words(("fcfs", "priority"))),
    _op(("--generation-config",), Words(("auto", "vllm"))),
    _op(("--uvicorn-log-level",),
        Words(("critical", "error", "warning", "info", "debug", "trace"))),
    _op(("--disable-uvicorn-access-log",), SWITCH),
    _op(("--disable-log-stats",), SWITCH),
    _op(("--enable-log-requests",), SWITCH),
    _op(("--no-enable-log-requests",), SWITCH),
    _op(("--max-parallel-loading-workers",), IntRange(1, 64)),
)  # fmt: skip

VLLM_0 = EngineFlags(
    engine="vllm",
    label="vLLM 0.x",
    first=(0, 0),
    last=(0, 99),
    flags=_VLLM_SYSTEM + _VLLM_OPERATOR,
    chat_templates=(),
    env=_VLLM_ENV,
    program="vLLM",
    alias="--served-model-name",
    required=_VLLM_REQUIRED,
    positional_model=True,
    reads_equals=True,
    deliveries=("container",),
)
