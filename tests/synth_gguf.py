"""Tiny random-weight GGUFs for tests (Qwen2, an iSWA OLMo2, a hybrid Qwen3.5): load and decode in llama.cpp in milliseconds.

The layout mirrors what convert_hf_to_gguf.py writes for Qwen2.5: architecture
`qwen2`, q/k/v biases, a byte-level BPE vocabulary (`gpt2` model, `qwen2`
pre-tokenizer), `<|endoftext|>`/`<|im_start|>`/`<|im_end|>` control tokens and the
Qwen2.5 ChatML template.  Weights are deterministic in `seed` and small, so logits
are finite.  gguf-py takes numpy arrays shaped like PyTorch weights (out, in); it
writes the dimensions reversed, which is llama.cpp's ne order ({in, out}).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGUFWriter, LlamaFileType, TokenType
from gguf.vocab import bytes_to_unicode

TINY_MODEL_NAME = "tiny-qwen2.gguf"

# Qwen2.5's tokenizer_config.json chat template, verbatim (as stored in its GGUFs).
QWEN25_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# A few byte-level BPE merges, applied in this order; "Ġ" is the space byte.
# llama.cpp refuses a gpt2 vocabulary without a merges key, and gguf-py silently
# drops empty arrays, so at least one merge is needed.
_MERGES = (
    "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "r e", "o n", "e r", "Ġ s", "e d", "Ġ w", "o r",
    "i s", "Ġ o", "Ġ c", "a n", "e n", "i t", "Ġ i", "a t", "in g", "Ġ d", "Ġ f", "Ġ p",
    "Ġ m", "Ġ b", "l l", "Ġ Ġ", "Ċ Ċ", "Ġa n", "Ġan d", "Ġo f", "Ġt o", "Ġi s", "Ġw or",
    "Ġwor l", "Ġworl d", "he l", "hel l", "hell o", "Ġ hello", "Ġ q", "Ġq u",
)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 256 byte tokens, merge results, 3 control tokens."""
    tokens = [bytes_to_unicode()[b] for b in range(256)]  # token id == byte value
    known = set(tokens)
    for merge in _MERGES:
        left, right = merge.split(" ")
        assert left in known and right in known and left + right not in known, merge
        tokens.append(left + right)
        known.add(left + right)
    types = [int(TokenType.NORMAL)] * len(tokens) + [int(TokenType.CONTROL)] * len(SPECIAL_TOKENS)
    return tokens + list(SPECIAL_TOKENS), types, list(_MERGES)


def write_tiny_qwen2(path: str | os.PathLike[str], *, n_layer: int = 2, **hparams) -> Path:
    """Write a random-weight qwen2 GGUF (all tensors F32) to `path` and return it.
    `hparams`: n_embd (64), n_head (4), n_head_kv (2), n_ff (128), n_ctx (4096), seed (0),
    chat_template (Qwen2.5's; None writes none)."""
    return _write_tiny(path, "qwen2", n_layer=n_layer, **hparams)


def write_tiny_olmo2_swa(
    path: str | os.PathLike[str], *, n_layer: int = 4, n_swa: int = 128, swa_pattern: int = 2, **hparams
) -> Path:
    """Write a random-weight olmo2 GGUF with sliding-window attention (an iSWA model: in every
    `swa_pattern` layers the last one attends the whole context, the others a window of `n_swa`)."""
    return _write_tiny(path, "olmo2", n_layer=n_layer, n_swa=n_swa, swa_pattern=swa_pattern, **hparams)


# The shapes of Qwen2.5's 0.5B and 1.5B (their config.json), for timing decode at real sizes
# on random weights where the real model cannot be had (a GPU machine without a registry).
QWEN25_SHAPES = {
    "0.5b": dict(n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864, n_vocab=151936, n_ctx=32768),
    "1.5b": dict(n_layer=28, n_embd=1536, n_head=12, n_head_kv=2, n_ff=8960, n_vocab=151936, n_ctx=32768),
}


def write_qwen2_shaped(path: str | os.PathLike[str], shape: str = "1.5b", *, dtype: str = "f16", seed: int = 0,
                       n_ctx: int | None = None) -> Path:
    """A random-weight qwen2 GGUF with the shapes of a real Qwen2.5 (`QWEN25_SHAPES`): the tiny
    vocabulary padded with unused tokens to the real size, output tied to the embeddings as in
    Qwen2.5, matrices in `dtype` (f16 or f32); `n_ctx` replaces the trained context it declares
    (e.g. 131072 to time decoding past the real model's 32k)."""
    shape_params = dict(QWEN25_SHAPES[shape], **({"n_ctx": n_ctx} if n_ctx else {}))
    return _write_tiny(path, "qwen2", **shape_params, dtype=dtype, seed=seed, tied=True)


def _write_tiny(path, arch: str, *, n_layer: int, n_embd: int = 64, n_head: int = 4, n_head_kv: int = 2,
                n_ff: int = 128, n_ctx: int = 4096, seed: int = 0, n_swa: int = 0, swa_pattern: int = 0,
                n_vocab: int = 0, dtype: str = "f32", tied: bool = False,
                chat_template: str | None = QWEN25_CHAT_TEMPLATE) -> Path:
    if n_embd % n_head or n_head % n_head_kv:
        raise ValueError("n_embd must divide by n_head, and n_head by n_head_kv")
    if dtype not in ("f32", "f16"):
        raise ValueError(f"dtype must be f32 or f16, not {dtype!r}")
    path = Path(path)
    tokens, types, merges = tiny_vocab()
    n_pad = max(0, n_vocab - len(tokens))
    if n_pad:  # unused filler ids before the control tokens, as in Qwen2.5's vocabulary
        n_plain = len(tokens) - len(SPECIAL_TOKENS)
        tokens = tokens[:n_plain] + [f"<|kvlocal_unused_{i}|>" for i in range(n_pad)] + tokens[n_plain:]
        types = types[:n_plain] + [int(TokenType.UNUSED)] * n_pad + types[n_plain:]
    n_vocab = len(tokens)
    n_embd_kv = n_embd // n_head * n_head_kv
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        if dtype == "f32":  # the tiny models' stream, unchanged
            return (rng.standard_normal(shape) * 0.02).astype(np.float32)
        values = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        return values.astype(np.float16) if len(shape) > 1 else values  # 1-D (biases) stay F32

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rand(n_vocab, n_embd),
        "output_norm.weight": ones(n_embd),
    }
    if not tied:  # a tied model reads the output matrix from token_embd
        tensors["output.weight"] = rand(n_vocab, n_embd)
    for i in range(n_layer):
        tensors |= {
            f"blk.{i}.attn_q.weight": rand(n_embd, n_embd),
            f"blk.{i}.attn_k.weight": rand(n_embd_kv, n_embd),
            f"blk.{i}.attn_v.weight": rand(n_embd_kv, n_embd),
            f"blk.{i}.attn_output.weight": rand(n_embd, n_embd),
            f"blk.{i}.ffn_gate.weight": rand(n_ff, n_embd),
            f"blk.{i}.ffn_up.weight": rand(n_ff, n_embd),
            f"blk.{i}.ffn_down.weight": rand(n_embd, n_ff),
        }
        if arch == "qwen2":
            tensors |= {
                f"blk.{i}.attn_norm.weight": ones(n_embd),
                f"blk.{i}.attn_q.bias": rand(n_embd),
                f"blk.{i}.attn_k.bias": rand(n_embd_kv),
                f"blk.{i}.attn_v.bias": rand(n_embd_kv),
                f"blk.{i}.ffn_norm.weight": ones(n_embd),
            }
        else:  # olmo2: q/k norms, norms after attention and FFN
            tensors |= {
                f"blk.{i}.attn_q_norm.weight": ones(n_embd),
                f"blk.{i}.attn_k_norm.weight": ones(n_embd_kv),
                f"blk.{i}.post_attention_norm.weight": ones(n_embd),
                f"blk.{i}.post_ffw_norm.weight": ones(n_embd),
            }

    writer = _new_writer(path, arch, LlamaFileType.MOSTLY_F16 if dtype == "f16" else LlamaFileType.ALL_F32,
                         n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if n_swa:
        writer.add_sliding_window(n_swa)
        writer.add_uint32(f"{arch}.attention.sliding_window_pattern", swa_pattern)
    _add_tokenizer(writer, tokens, types, merges, chat_template)
    return _finish(writer, tensors, path)


def _new_writer(path: Path, arch: str, file_type: LlamaFileType, *, n_ctx: int, n_embd: int, n_layer: int,
                n_ff: int, n_head: int, n_head_kv: int) -> GGUFWriter:
    """A writer with the header every tiny model shares."""
    writer = GGUFWriter(str(path), arch)
    writer.add_type("model")
    writer.add_name(f"kvlocal tiny {arch} (random weights)")
    writer.add_file_type(file_type)
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    return writer


def _add_tokenizer(writer: GGUFWriter, tokens: list[str], types: list[int], merges: list[str],
                   chat_template: str | None) -> None:
    """The tiny byte-level BPE vocabulary's keys, with Qwen2.5's special token ids and template."""
    eot = tokens.index("<|endoftext|>")
    im_end = tokens.index("<|im_end|>")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eot)  # as in Qwen2.5's GGUFs; add_bos_token is false
    writer.add_eos_token_id(im_end)
    writer.add_eot_token_id(im_end)
    writer.add_pad_token_id(eot)
    writer.add_add_bos_token(False)
    if chat_template is not None:  # None: a base model without a template
        writer.add_chat_template(chat_template)


def _finish(writer: GGUFWriter, tensors: dict[str, np.ndarray], path: Path) -> Path:
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_qwen35(
    path: str | os.PathLike[str], *, n_layer: int = 8, n_embd: int = 128, n_head: int = 4, n_head_kv: int = 2,
    head_dim: int = 64, n_rot: int = 16, rope_sections: tuple[int, int, int, int] = (3, 3, 2, 0), n_ff: int = 256,
    full_attention_interval: int = 4, ssm_d_conv: int = 4, ssm_d_state: int = 32, ssm_n_group: int = 2,
    ssm_dt_rank: int = 4, n_ctx: int = 4096, seed: int = 0, chat_template: str | None = QWEN25_CHAT_TEMPLATE,
) -> Path:
    """Write a random-weight qwen35 GGUF (Qwen3.5's hybrid decoder, all tensors F32) to `path` and return it.

    As convert_hf_to_gguf.py writes Qwen3.5 (conversion/qwen.py, Qwen3_5TextModel), scaled down:
    in every `full_attention_interval` layers the last is full attention (GQA over a KV cache, q/k
    RMS norms, partial interleaved M-RoPE on `n_rot` of `head_dim` dimensions with
    `rope.dimension_sections`, an output gate: attn_q yields query and gate, 2*n_head*head_dim
    rows), the others Gated DeltaNet linear attention with a recurrent state (a causal conv over
    the fused q/k/v projection `attn_qkv`, output gate `attn_gate`; `ssm_n_group` key heads and
    `ssm_dt_rank` value heads of `ssm_d_state` dimensions, so ssm.inner_size = ssm_d_state *
    ssm_dt_rank). head_dim is not n_embd / n_head, as in Qwen3.5 (key_length and value_length are
    written). Layers 3 and 7 attend fully by default. The tiny qwen2 vocabulary and ChatML template
    (Qwen3.5's own template and vocabulary are not needed to decode)."""
    if n_head % n_head_kv or ssm_dt_rank % ssm_n_group:
        raise ValueError("n_head must divide by n_head_kv, and ssm_dt_rank (value heads) by ssm_n_group (key heads)")
    if n_rot % 2 or not 0 < n_rot <= head_dim or head_dim % 2:
        raise ValueError("n_rot must be even and at most head_dim (even)")
    if len(rope_sections) != 4 or sum(rope_sections) != n_rot // 2:
        raise ValueError("rope_sections: 4 sections of rotated dimension pairs summing to n_rot / 2 "
                         "(Qwen3.5: [11, 11, 10, 0] for 64 rotated dimensions)")
    path = Path(path)
    tokens, types, merges = tiny_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    # llama.cpp's shapes (llama_model_qwen35::load_arch_tensors) in its ne order are the reverse of these
    key_dim = ssm_d_state * ssm_n_group  # q and k of the linear attention
    value_dim = ssm_d_state * ssm_dt_rank  # v, the gate z and the output; ssm.inner_size
    conv_dim = 2 * key_dim + value_dim  # the conv runs over q, k and v together
    tensors: dict[str, np.ndarray] = {
        "token_embd.weight": rand(n_vocab, n_embd),
        "output_norm.weight": ones(n_embd),
        "output.weight": rand(n_vocab, n_embd),
    }
    for i in range(n_layer):
        tensors |= {
            f"blk.{i}.attn_norm.weight": ones(n_embd),
            f"blk.{i}.post_attention_norm.weight": ones(n_embd),  # the norm before the FFN
        }
        if (i + 1) % full_attention_interval:  # Gated DeltaNet
            # A = -exp(A_log) < 0 per value head: a decay of exp(A * softplus(alpha + dt_bias)) per token;
            # A in [0.02, 0.5] keeps 50-97% of the state per token, so the state matters for many tokens
            a_log = np.log(rng.uniform(0.02, 0.5, ssm_dt_rank))
            tensors |= {
                f"blk.{i}.attn_qkv.weight": rand(conv_dim, n_embd),
                f"blk.{i}.attn_gate.weight": rand(value_dim, n_embd),  # z, the gated norm's gate
                f"blk.{i}.ssm_conv1d.weight": (rng.standard_normal((conv_dim, ssm_d_conv)) * 0.5).astype(np.float32),
                f"blk.{i}.ssm_dt.bias": ones(ssm_dt_rank),
                f"blk.{i}.ssm_a": (-np.exp(a_log)).astype(np.float32),  # no .weight suffix, as converted
                f"blk.{i}.ssm_beta.weight": rand(ssm_dt_rank, n_embd),
                f"blk.{i}.ssm_alpha.weight": rand(ssm_dt_rank, n_embd),
                f"blk.{i}.ssm_norm.weight": ones(ssm_d_state),
                f"blk.{i}.ssm_out.weight": rand(n_embd, value_dim),
            }
        else:  # full attention with an output gate: attn_q holds query and gate per head
            tensors |= {
                f"blk.{i}.attn_q.weight": rand(2 * n_head * head_dim, n_embd),
                f"blk.{i}.attn_k.weight": rand(n_head_kv * head_dim, n_embd),
                f"blk.{i}.attn_v.weight": rand(n_head_kv * head_dim, n_embd),
                f"blk.{i}.attn_output.weight": rand(n_embd, n_head * head_dim),
                f"blk.{i}.attn_q_norm.weight": ones(head_dim),
                f"blk.{i}.attn_k_norm.weight": ones(head_dim),
            }
        tensors |= {
            f"blk.{i}.ffn_gate.weight": rand(n_ff, n_embd),
            f"blk.{i}.ffn_up.weight": rand(n_ff, n_embd),
            f"blk.{i}.ffn_down.weight": rand(n_embd, n_ff),
        }

    writer = _new_writer(path, "qwen35", LlamaFileType.ALL_F32, n_ctx=n_ctx, n_embd=n_embd, n_layer=n_layer,
                         n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10_000_000.0)
    writer.add_rope_dimension_count(n_rot)  # partial RoPE: n_rot of head_dim dimensions
    writer.add_rope_dimension_sections(list(rope_sections))  # required by llama.cpp's qwen35 loader
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_ssm_conv_kernel(ssm_d_conv)
    writer.add_ssm_state_size(ssm_d_state)
    writer.add_ssm_group_count(ssm_n_group)
    writer.add_ssm_time_step_rank(ssm_dt_rank)
    writer.add_ssm_inner_size(value_dim)
    writer.add_full_attention_interval(full_attention_interval)
    _add_tokenizer(writer, tokens, types, merges, chat_template)
    return _finish(writer, tensors, path)


def write_truncated(path_src: str | os.PathLike[str], path_dst: str | os.PathLike[str], keep: float = 0.75) -> Path:
    """Copy the first `keep` fraction of `path_src` to `path_dst` (a cut-off download)."""
    data = Path(path_src).read_bytes()
    dst = Path(path_dst)
    dst.write_bytes(data[: int(len(data) * keep)])
    return dst


def make_tiny_model(directory: str | os.PathLike[str]) -> Path:
    """`directory`/tiny-qwen2.gguf with default hparams, written once (fixture helper)."""
    path = Path(directory) / TINY_MODEL_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        write_tiny_qwen2(tmp)
        os.replace(tmp, path)
    return path


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write a random-weight qwen2 GGUF with a real Qwen2.5's shapes.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=[*sorted(QWEN25_SHAPES), "tiny"], default="1.5b",
                        help="tiny: the tests' tiny qwen2 with a 32k context (for rehearsals)")
    parser.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    parser.add_argument("--n-ctx", type=int, default=None, help="the trained context the model declares "
                        "(default: the real model's; tiny: 32768)")
    parser.add_argument("--quantize", choices=["q4_k_m", "q8_0"], default=None,
                        help="then quantize it with the engine's llama_model_quantize (the default model is q4_k_m)")
    args = parser.parse_args()
    tmp = args.out.with_name(args.out.name + ".tmp")
    if args.shape == "tiny":
        write_tiny_qwen2(tmp, n_ctx=args.n_ctx or 32768)
    else:
        write_qwen2_shaped(tmp, args.shape, dtype=args.dtype, n_ctx=args.n_ctx)
    if args.quantize:
        from kvlocal.engine import quantize_model  # the engine is needed only for this

        quantized = args.out.with_name(args.out.name + ".q.tmp")
        quantize_model(tmp, quantized, args.quantize)
        os.replace(quantized, args.out)
        tmp.unlink()
    else:
        os.replace(tmp, args.out)
    print(f"{args.out}: random qwen2, shape {args.shape}{', ' + args.quantize if args.quantize else ''}, "
          f"{args.out.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
