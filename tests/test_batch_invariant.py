"""--batch-invariant (models/batch_invariant.py): a token's numbers do not depend on what it is batched
with, nor on how its prompt was chunked, on every dtype x quantization x kernels the defaults can pick.

- Every dense GEMM the engine can run computes a row of a fixed block alike at any position, beside
  any rows; every quantized kernel computes each row alone at any row count.
- Attention, rows alone: a row's output is the same in any batch, and it is attention.
- LLM: a prompt alone, among others, chunked, and after a prefix-cache hit gives the same tokens and
  logprobs, bit for bit.
- 1P1D pull and push equal a colocated node on bf16 + int4 (forced: the AMX default), 20 prompts at once.
"""

from __future__ import annotations

import concurrent.futures
from typing import Callable

import httpx
import pytest
import torch
import torch.nn.functional as F
from servers import MODEL, Procs

from pdserve import LLM, SamplingParams
from pdserve.models.attention import RowsAlone, _attend_rows_alone
from pdserve.models.batch_invariant import INVARIANT_PARTITION_BLOCKS, INVARIANT_ROWS, in_fixed_blocks
from pdserve.models.quantization import native_int4_kernel, quantize_int4, quantize_int8, quantize_int8_groups
from pdserve.platform import CpuInfo

N, K = 1728, 576  # SmolLM2's fused QKV projection


WEIGHT = torch.randn(N, K, generator=torch.Generator().manual_seed(0))


def dense_gemms() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every dense GEMM a Linear or the output head can run (prefill, and decode unquantized)."""
    bf16 = WEIGHT.bfloat16()
    found = {"float32": lambda x: F.linear(x, WEIGHT), "bfloat16": lambda x: F.linear(x.bfloat16(), bf16)}
    if CpuInfo.detect().onednn_bf16:
        packed = torch.ops.mkldnn._reorder_linear_weight(bf16)
        found["onednn bf16"] = lambda x: torch.ops.mkldnn._linear_pointwise(x.bfloat16(), packed, None, "none", [], "")
    return found


def quantized_gemms(ops) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Every quantized kernel batch-invariant decode rows can run."""
    int4, _ = quantize_int4(WEIGHT)
    int8, _ = quantize_int8(WEIGHT)
    head = quantize_int8_groups(WEIGHT)
    found = {"int4": lambda x: int4(x.bfloat16()), "int8": lambda x: int8(x.bfloat16())}
    if ops is not None:
        found["int8 head"] = lambda x: ops.int8_head(x.float().contiguous(), head.codes, head.scales, rows_alone=True)
    if native_int4_kernel(ops) is not None:  # AVX512-BF16 CPUs
        native_int4, _ = quantize_int4(WEIGHT, native_int4_kernel(ops))
        # As batch-invariant layers call it: one path at any row count (AMX's tiles where present).
        found["int4 native"] = lambda x: native_int4(x, rows_alone=True)
    return found


@pytest.fixture(scope="module")
def native(request):
    """pdserve's C++ kernels where they are built, else None (the portable path is tested regardless)."""
    try:
        return request.getfixturevalue("ops")
    except pytest.skip.Exception:
        return None


def test_every_quantized_kernel_computes_each_row_alone_at_any_row_count(native):
    x = torch.randn(70, K, generator=torch.Generator().manual_seed(3))
    for name, kernel in quantized_gemms(native).items():
        alone = torch.cat([kernel(x[i : i + 1]) for i in range(len(x))])
        for rows in (2, 3, 5, 8, 16, 17, 33, 70):
            assert torch.equal(kernel(x[:rows]), alone[:rows]), (name, rows)


def test_every_dense_gemm_computes_a_row_alike_wherever_it_sits_in_a_fixed_block():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, K, generator=gen)
    for name, gemm in dense_gemms().items():
        batched = in_fixed_blocks(gemm, x)
        alone = torch.cat([in_fixed_blocks(gemm, x[i : i + 1]) for i in range(len(x))])
        assert torch.equal(batched, alone), name
        row = x[3]
        for position in (0, 7, INVARIANT_ROWS - 1):
            block = torch.randn(INVARIANT_ROWS, K, generator=gen)
            block[position] = row
            assert torch.equal(gemm(block)[position], alone[3]), (name, position)


def test_attention_rows_alone_is_attention_and_does_not_depend_on_the_batch(native):
    """Two sequences' rows (a prefill chunk of one, decodes of both) through the C++ kernel and the
    portable SDPA: each row equals that row alone, and a float64 reference within rounding."""
    gen = torch.Generator().manual_seed(2)
    block_size, heads, kv_heads, dim = 16, 6, 2, 64
    kv_cache = torch.randn(2, 20, block_size, kv_heads, dim, generator=gen)
    tables = [[3, 7, 1, 12, 5], [9, 2, 15]]
    rows = [(0, p) for p in range(30, 70)] + [(1, 33), (0, 70)]  # (sequence, position)
    table_rows = torch.tensor([tables[s] + [0] * (5 - len(tables[s])) for s, _ in rows])
    lens = torch.tensor([p + 1 for _, p in rows])
    q = torch.randn(len(rows), heads, dim, generator=gen)
    scale = dim**-0.5
    kernels = {"portable": None} | ({"native": native.paged_decode_attention} if native is not None else {})
    for name, kernel in kernels.items():
        def attend(i: int, j: int) -> torch.Tensor:
            out = torch.empty_like(q[i:j])
            rows_alone = RowsAlone(table_rows[i:j], lens[i:j], INVARIANT_PARTITION_BLOCKS, [(0, j - i)])
            _attend_rows_alone(q[i:j], kv_cache, rows_alone, kernel, scale, out)
            return out

        batched = torch.cat([attend(0, 40), attend(40, 41), attend(41, 42)])
        alone = torch.cat([attend(i, i + 1) for i in range(len(rows))])
        assert torch.equal(batched, alone), name
        for i, (s, p) in enumerate(rows):
            slots = torch.tensor(tables[s]).repeat_interleave(block_size) * block_size + torch.arange(block_size).repeat(
                len(tables[s]))
            keys, values = (kv_cache[t].reshape(-1, kv_heads, dim)[slots[: p + 1]].double() for t in (0, 1))
            scores = torch.einsum("hd,lhd->hl", q[i].double(), keys.repeat_interleave(heads // kv_heads, 1)) * scale
            want = torch.einsum("hl,lhd->hd", scores.softmax(-1), values.repeat_interleave(heads // kv_heads, 1))
            torch.testing.assert_close(alone[i].double(), want, atol=2e-5, rtol=1e-4)


def outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in llm.generate(prompts, params)]


PROMPT_IDS = [[1 + (7 * i + 3 * j) % 4000 for j in range(n)] for i, n in enumerate((5, 37, 90, 16, 61))]


@pytest.mark.parametrize("dtype, quantization, kernels", [
    ("bfloat16", "int4", "auto"), ("float32", "none", "auto"), ("bfloat16", "int8", "portable"),
    ("float32", "int4", "portable")])
def test_a_prompt_alone_batched_chunked_and_cached_gives_the_same_numbers(random_llama, dtype, quantization,
                                                                          kernels):
    def llm(**options) -> LLM:
        return LLM(random_llama, dtype=dtype, quantization=quantization, kernels=kernels, batch_invariant=True,
                   kv_cache_memory_gib=0.05, **options)

    whole = llm(enable_prefix_caching=False)
    assert whole.engine.labels()["batch_invariant"] == "true"
    alone = [outputs(whole, [p])[0] for p in PROMPT_IDS]
    assert outputs(whole, PROMPT_IDS) == alone  # every prompt's prefill and decodes in one batch
    chunked = llm(max_num_batched_tokens=24)  # prompts in 24-token chunks beside the others' decodes
    assert outputs(chunked, PROMPT_IDS) == alone
    # A prefix-cache hit: the call before cached this prompt's 5 full blocks; it computes from token 80.
    assert outputs(chunked, [PROMPT_IDS[2]]) == [alone[2]]
    # The same model as the normal mode computes it, up to rounding: the first token's logprob.
    normal = LLM(random_llama, dtype=dtype, quantization=quantization, kernels=kernels, kv_cache_memory_gib=0.05)
    first = [(o.token_ids[0], o.logprobs[0].logprob) for o in normal.generate(
        PROMPT_IDS, SamplingParams(temperature=0, max_tokens=1, logprobs=1))]
    for (tokens, logprobs), (token, logprob) in zip(alone, first):
        assert abs(logprobs[0] - logprob) < (1e-4 if dtype == "float32" else 0.05), (logprobs[0], logprob)


def test_a_model_without_a_batch_invariant_path_is_refused(mla_model):
    with pytest.raises(ValueError, match="--batch-invariant: DeepseekV3ForCausalLM has its own attention"):
        LLM(mla_model, dtype="float32", batch_invariant=True, kv_cache_memory_gib=0.02)


PROMPTS = [f"Question {i}: " + " ".join(["Tell me about the river", "What is the capital of Italy?",
                                         "Write a haiku about autumn leaves.", "def add(a, b):",
                                         "The first law of thermodynamics states"][: 1 + i % 5]) for i in range(20)]


def test_pd_pull_and_push_equal_colocated_on_bf16_int4_concurrently(tmp_path):
    """The issue's bar: bf16 + int4 (auto picks it on AMX; oneDNN emulates bf16 elsewhere), 20
    prompts at once through 1P1D pull and push, each answer and its logprobs equal to a colocated
    node's, itself loaded with the same 20 at once."""
    node = ["--batch-invariant", "--dtype", "bfloat16", "--quantization", "int4", "--kv-cache-memory", "0.1"]
    with Procs(tmp_path) as procs:
        both = procs.start(["serve", *node], "both")
        p = procs.start(["serve", "--role", "prefill", *node], "p")
        d = procs.start(["serve", "--role", "decode", "--kv-wait-timeout", "120", *node], "d")
        proxies = {mode: procs.start(["proxy", "--mode", mode, "--prefill", p.url, "--decode", d.url], mode)
                   for mode in ("pull", "push")}

        def ask(url: str, prompt: str) -> tuple[str, list[float]]:
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24,
                                                         "temperature": 0, "logprobs": 0}, timeout=300)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["text"], choice["logprobs"]["token_logprobs"]

        answers = {}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            for name, url in (("colocated", both.url), ("pull", proxies["pull"].url), ("push", proxies["push"].url)):
                answers[name] = list(pool.map(lambda prompt: ask(url, prompt), PROMPTS))
        assert 'batch_invariant="true"' in httpx.get(d.url + "/metrics").text
        for mode in ("pull", "push"):
            assert answers[mode] == answers["colocated"], f"{mode}: " + first_differences(answers[mode],
                                                                                        answers["colocated"])


def first_differences(got: list[tuple[str, list[float]]], want: list[tuple[str, list[float]]]) -> str:
    """Which prompts differ and where first, in a line each (CI shows the tail: a whole diff hid it)."""
    lines = []
    for i, ((text, logprobs), (want_text, want_logprobs)) in enumerate(zip(got, want)):
        if (text, logprobs) != (want_text, want_logprobs):
            at = next((j for j, (a, b) in enumerate(zip(logprobs, want_logprobs)) if a != b), None)
            where = f"token {at}: logprob {logprobs[at]!r} vs {want_logprobs[at]!r}" if at is not None else "text only"
            lines.append(f"prompt {i} differs first at {where}")
    return f"{len(lines)} of {len(want)} answers differ from the colocated node's:\n" + "\n".join(lines)
