"""Speculative decoding: greedy output identical to plain decoding for every drafter (batches of
different lengths, runs cut by max_tokens, stop ids, stop strings and EOS inside the accepted run), no
KV page left behind, the sampled distribution equal to the target's (chi-square), the adaptive k, and
the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from warpforge.llm.engine import LLM
from warpforge.llm.sampler import Sampler, SamplingTensors
from warpforge.llm.sampling import SamplingParams
from warpforge.llm.spec_step import verify
from warpforge.llm.speculative import PROBE_EVERY, AdaptiveK, SpeculativeConfig, speculative_config

from .engine_helpers import checkpoint, loaded, one_thread  # noqa: F401

N = 40


@pytest.fixture(scope="module")
def twin():
    """The tiny llama loaded a second time: a draft model that agrees with the target (acceptance ~1),
    so drafted runs are long and the stop conditions land inside them."""
    from warpforge.llm.loader import load

    return load(checkpoint("llama"), dtype=torch.float32, device="cpu")


def make(model, spec=None, **kw) -> LLM:
    kw.setdefault("page_size", 4)
    kw.setdefault("num_pages", 256)
    return LLM(model, max_model_len=128, speculative=spec, **kw)


def spec_prompts() -> list[list[int]]:
    """Different lengths; the first two repeat a phrase, so n-gram lookup finds drafts in the prompt."""
    g = torch.Generator().manual_seed(1)
    phrase = torch.randint(5, 500, (7,), generator=g).tolist()
    rand = torch.randint(5, 500, (40,), generator=g).tolist()
    return [phrase * 4, rand[:5] + phrase * 2, rand[:23], rand[30:31]]


def assert_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_pages == bm.num_pages and not llm.engine.requests
    assert not any(p.ref_count for p in bm.pages)


def greedy(n: int = N, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_greedy_identical_to_plain(method, twin):
    arch = "gemma3" if method == "self" else "llama"  # gemma3: sliding windows, sandwich norms, 4 layers
    model = loaded(arch)
    ps = spec_prompts()
    params = [greedy(N), greedy(N - 3), greedy(7), greedy(N)]  # max_tokens lands inside drafted runs
    ref = make(model).generate(ps, params)
    kw = {"draft_model": twin} if method == "draft" else {"draft_layers": 2} if method == "self" else {"ngram_min": 1}
    llm = make(model, SpeculativeConfig(method=method, k=4, adaptive=False, **kw))
    outs = llm.generate(ps, params)
    for p, o, r in zip(ps, outs, ref):
        assert o.token_ids == r.token_ids, f"{method}: prompt of {len(p)} tokens"
        assert o.finish_reason == r.finish_reason == "length"
    s = llm.engine.spec.stats
    assert s.num_spec_steps > 0 and s.num_draft_tokens > 0 and s.num_accepted_tokens > 0
    if method == "draft":
        assert s.acceptance_rate > 0.9  # the same weights draft: only float noise may reject
        assert not llm.engine.spec.drafter._seen  # per-sequence state gone with the sequences
    assert_clean(llm)
    # Chunked prefill beside drafted decodes, and a step budget that cuts the drafts.
    llm = make(model, SpeculativeConfig(method=method, k=4, adaptive=False, **kw), max_num_batched_tokens=9)
    assert [o.token_ids for o in llm.generate(ps, params)] == [r.token_ids for r in ref]
    assert_clean(llm)


def test_stops_inside_accepted_runs(twin):
    model = loaded("llama")
    p = spec_prompts()[2]
    ref = make(model).generate(p, greedy())[0].token_ids
    spec = SpeculativeConfig(method="draft", draft_model=twin, k=6, adaptive=False)
    llm = make(model, spec)
    for i in (5, 9, 13):  # stop ids at several offsets into 6-token runs
        out = llm.generate(p, greedy(stop_token_ids=[ref[i]]))[0]
        assert out.token_ids == ref[:ref.index(ref[i]) + 1] and out.finish_reason == "stop"
    plain = make(model)
    text = plain.generate(p, greedy())[0].text
    for start in (6, 11):
        stop = text[start:start + 2]
        want = plain.generate(p, greedy(stop=[stop]))[0]
        out = llm.generate(p, greedy(stop=[stop]))[0]
        assert (out.token_ids, out.text, out.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert len(out.token_ids) < N and out.finish_reason == "stop"
    assert_clean(llm)


def test_eos_inside_accepted_run():
    from warpforge.llm.loader import load

    model = loaded("qwen2")  # reaches EOS early from this prompt (tests/llm/test_engine.py)
    from .engine_helpers import prompts

    p = prompts()[1]
    want = make(model).generate(p, SamplingParams(temperature=0.0, max_tokens=N))[0]
    assert want.finish_reason == "stop" and len(want.token_ids) < N
    twin2 = load(checkpoint("qwen2"), dtype=torch.float32, device="cpu")
    llm = make(model, SpeculativeConfig(method="draft", draft_model=twin2, k=8, adaptive=False))
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=N))[0]
    assert out.token_ids == want.token_ids and out.finish_reason == "stop"
    assert llm.engine.spec.stats.num_accepted_tokens > 0
    assert_clean(llm)


# ---- the distribution at temperature > 0 ---------------------------------------------------------

def chi2_critical(df: int, z: float = 3.090) -> float:
    """Chi-square quantile by Wilson-Hilferty; z 3.090: the 0.999 quantile (a false alarm 1 in 1000)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_two_sample(a: dict, b: dict) -> tuple[float, int]:
    """Homogeneity of two samples' counts over the cells with at least 5 expected in each; -> (X^2, df)."""
    na, nb = sum(a.values()), sum(b.values())
    cells = [c for c in set(a) | set(b) if (a.get(c, 0) + b.get(c, 0)) * min(na, nb) / (na + nb) >= 5]
    x2 = 0.0
    for c in cells:
        tot = a.get(c, 0) + b.get(c, 0)
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        x2 += (a.get(c, 0) - ea) ** 2 / ea + (b.get(c, 0) - eb) ** 2 / eb
    return x2, len(cells) - 1


@pytest.mark.parametrize("point_mass", [False, True])
def test_verify_samples_the_target_distribution(point_mass):
    """verify() on synthetic distributions over 6 tokens: the first output token (accepted draft or the
    resample) must follow p_0 whatever q is. 40,000 rows; against p_0 by a goodness-of-fit chi-square
    at the 0.999 quantile (5 degrees of freedom: 20.7). Resampling rejections from p instead of
    norm(max(0, p - q)) scored X^2 = 3,100 and 3,400 here."""
    V, K, B = 6, 3, 40_000
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q = torch.softmax(torch.randn(K, V, generator=g) * 1.5, dim=-1)
    if point_mass:  # n-gram drafts: fixed tokens, q = 1 on them
        drafts = torch.tensor([[2, 0, 5]]).expand(B, K).contiguous()
        probs = None
    else:
        drafts = torch.multinomial(q, B, replacement=True, generator=g).T.contiguous()  # [B, K], row j from q_j
        probs = q[None].expand(B, K, V).contiguous()
    st = SamplingTensors.from_params([SamplingParams(temperature=1.0)] * B, None, None, V, "cpu", num_outputs=[0] * B)
    logits = p_logits[None].expand(B, K + 1, V).contiguous()
    n_acc, nxt = verify(logits, drafts, torch.full((B,), K), probs, st, Sampler(0), torch.Generator().manual_seed(1))
    first = torch.where(n_acc > 0, drafts[:, 0], nxt)
    counts = torch.bincount(first, minlength=V).double()
    expect = torch.softmax(p_logits[0].double(), dim=-1) * B
    x2 = float(((counts - expect) ** 2 / expect).sum())
    assert x2 < chi2_critical(V - 1), (x2, counts.tolist(), expect.tolist())
    assert 0 < float((n_acc == 0).double().mean()) < 1  # both branches taken: accepted and resampled
    # Greedy rows: accepted while the draft is the argmax; then the argmax.
    st = SamplingTensors.from_params([SamplingParams(temperature=0.0)] * 2, None, None, V, "cpu", num_outputs=[0, 0])
    top = p_logits.argmax(dim=-1)
    d = torch.stack([top[:K], torch.tensor([int(top[0]), int(top[1]), (int(top[2]) + 1) % V])])
    n_acc, nxt = verify(p_logits[None].expand(2, K + 1, V), d, torch.tensor([K, K]), None, st, Sampler(0),
                        torch.Generator())
    assert n_acc.tolist() == [K, 2] and nxt.tolist() == [int(top[K]), int(top[2])]


def lookup_prompt(model) -> list[int]:
    """A page-aligned prompt (24 tokens, pages of 4) ending in a token that occurred earlier followed by
    the model's greedy next token: n-gram lookup drafts a likely token, accepted only sometimes at
    temperature 1. Every copy after the first is a full prefix-cache hit, so it drafts at its first token."""
    g = torch.Generator().manual_seed(2)
    r = torch.randint(5, 500, (21,), generator=g).tolist()
    a, x = r[0], 5
    plain = make(model)
    for _ in range(6):  # the earlier x changes the greedy next token a little: iterate to a fixed point
        q = r[:10] + [a, x] + r[10:] + [a]
        nxt = plain.generate(q, greedy(1))[0].token_ids[0]
        if nxt == x:
            break
        x = nxt
    return q


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_sampled_tokens_match_plain_sampling(method):
    """Engine level: the first two sampled tokens (temperature 1, top-k 4: at most 16 pairs) of 1,000
    requests, drafted by a model that partly disagrees with the target (its LM head perturbed) or by
    n-gram lookup (point masses), against 1,000 plain ones; two-sample chi-square at the 0.999 quantile
    (15 degrees of freedom: 37.8). A verifier that resamples rejections from p instead of
    norm(max(0, p - q)) scored X^2 = 133 (draft model, 1,200 requests) and 82 (n-gram) here."""
    from warpforge.llm.loader import load

    model = loaded("llama")
    if method == "draft":
        other = load(checkpoint("llama"), dtype=torch.float32, device="cpu")
        head = other[0].lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * head.std() * 0.7)
        p = spec_prompts()[0]
        spec = SpeculativeConfig(method="draft", draft_model=other, k=2, adaptive=False, max_batch_size=10_000)
    else:
        p = lookup_prompt(model)
        spec = SpeculativeConfig(method="ngram", ngram_min=1, k=2, adaptive=False, max_batch_size=10_000)
    n = 1000
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=3, ignore_eos=True)
    kw = dict(max_num_seqs=n, max_num_batched_tokens=4 * n, num_pages=3 * n)
    samples = []
    for cfg in (None, spec):
        llm = make(model, cfg, **kw)
        llm.generate(p, params)  # its pages enter the prefix cache: every request below starts there
        samples.append(llm.generate([p] * n, params))
    s = llm.engine.spec.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens  # drafts both kept and rejected
    a: dict = {}
    b: dict = {}
    for counts, outs in ((a, samples[0]), (b, samples[1])):
        for o in outs:
            key = tuple(o.token_ids[:2])
            counts[key] = counts.get(key, 0) + 1
    x2, df = chi2_two_sample(a, b)
    assert df >= 4 and x2 < chi2_critical(df), (x2, df)
    assert_clean(llm)


# ---- adaptive k, pages, refusals -----------------------------------------------------------------

def test_adaptive_k_rule():
    rule = AdaptiveK(8, draft_cost=0.0)
    for _ in range(40):
        rule.update(accepted=9, rejected=1)  # ~0.9 per draft
    assert rule.best_k() == 8 and rule.next_k() == 8
    for _ in range(80):
        rule.update(accepted=0, rejected=4)
    assert rule.best_k() == 0
    ks = [rule.next_k() for _ in range(2 * PROBE_EVERY)]
    assert ks.count(1) == 2 and ks.count(0) == 2 * PROBE_EVERY - 2  # a probe every PROBE_EVERY steps
    costly = AdaptiveK(8, draft_cost=0.5)  # a drafter half the target's cost needs a high rate to pay
    costly.accepted, costly.rejected = 6.0, 4.0
    assert costly.best_k() == 0 and AdaptiveK(8, 0.0, adaptive=False).next_k() == 8


def test_speculation_turns_off_when_it_does_not_pay():
    model = loaded("llama")
    g = torch.Generator().manual_seed(5)
    p = torch.randint(5, 500, (30,), generator=g).tolist()
    llm = make(model, SpeculativeConfig(method="self", draft_layers=1, k=4))  # random weights: drafts miss
    ref = make(model).generate(p, greedy(60))[0].token_ids
    assert llm.generate(p, greedy(60))[0].token_ids == ref
    spec = llm.engine.spec
    assert spec.k_rule.best_k() == 0 and spec.stats.num_spec_steps < 30  # off after the first misses
    big = make(model, SpeculativeConfig(method="ngram", max_batch_size=2, adaptive=False))
    big.generate(spec_prompts(), greedy(12))
    assert big.engine.spec.stats.num_spec_steps == 0  # 4 sequences > max_batch_size 2
    assert_clean(big)


def test_reserve_and_trim_pages():
    from warpforge.llm.block_manager import BlockManager
    from warpforge.llm.sequence import Sequence

    bm = BlockManager(6, 4)
    seq = Sequence(list(range(6)))
    bm.allocate(seq)
    assert len(seq.block_table) == 2
    assert bm.reserve(seq, 6 + 5) == 11 and len(seq.block_table) == 3
    assert bm.reserve(seq, 6 + 30) == 24 and bm.num_free_pages == 0  # as far as the pool allows
    v = seq.block_table_version
    bm.trim(seq)
    assert len(seq.block_table) == 2 and bm.num_free_pages == 4 and seq.block_table_version > v
    bm.free(seq)
    assert bm.num_free_pages == 6


@pytest.mark.parametrize("bad, message", [
    (dict(method="medusa"), "speculative.method: expected one of"),
    (dict(k=0), "speculative.k: expected an integer in [1, 32], got 0"),
    (dict(method="draft"), "speculative.draft_model: method 'draft' needs a draft model"),
    (dict(method="ngram", draft_model="x"), "speculative.draft_model: only method 'draft' takes"),
    (dict(method="ngram", draft_layers=2), "speculative.draft_layers: only method 'self' takes"),
    (dict(ngram_min=5, ngram_max=3), "speculative.ngram_min: expected an integer in [1, 3], got 5"),
    (dict(max_batch_size=0), "speculative.max_batch_size: expected an integer >= 1, got 0"),
    (dict(adaptive="yes"), "speculative.adaptive: expected a bool, got 'yes'"),
])
def test_config_refusals(bad, message):
    with pytest.raises(ValueError) as e:
        SpeculativeConfig(**bad)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_engine_refusals(twin):
    model = loaded("llama")
    with pytest.raises(ValueError, match=r"speculative: expected a SpeculativeConfig"):
        make(model, 3)
    with pytest.raises(ValueError, match=r"speculative: unknown settings \['kk'\]"):
        speculative_config({"kk": 2})
    assert speculative_config("ngram").method == "ngram" and speculative_config({"k": 2}).k == 2
    with pytest.raises(ValueError, match=r"speculative.draft_layers: expected 1..1 \(the target has 2 layers\), got 2"):
        make(model, SpeculativeConfig(method="self", draft_layers=2))
    with pytest.raises(ValueError, match=r"the draft model must be a separate model"):
        make(model, SpeculativeConfig(method="draft", draft_model=model))
    from warpforge.llm.loader import load
    from warpforge.llm.random_weights import random_checkpoint

    from .engine_helpers import _ROOT

    wide = load(random_checkpoint(_ROOT / "vocab1024", "llama-tiny", dtype=torch.float32), dtype=torch.float32,
                device="cpu")  # vocabulary of 1024 against the target's 512
    with pytest.raises(ValueError, match=r"speculative.draft_model: vocabulary of 1024 tokens, the target has 512"):
        make(model, SpeculativeConfig(method="draft", draft_model=wide))


def test_server_metrics_show_acceptance(twin):
    pytest.importorskip("prometheus_client")
    from warpforge.llm import AsyncLLM
    from warpforge.serve.metrics import ServerMetrics

    llm = make(loaded("llama"), SpeculativeConfig(method="draft", draft_model=twin, k=3, adaptive=False))
    llm.generate(spec_prompts()[:2], greedy(12))
    s = llm.engine.spec.stats
    text = ServerMetrics(AsyncLLM(llm.engine)).render().decode()
    values = {line.split()[0]: float(line.split()[1])
              for line in text.splitlines() if line.startswith("warpforge_spec")}
    assert values["warpforge_spec_decode_num_draft_tokens_total"] == s.num_draft_tokens > 0
    assert values["warpforge_spec_decode_num_accepted_tokens_total"] == s.num_accepted_tokens > 0
    assert values["warpforge_spec_decode_draft_acceptance_rate"] == pytest.approx(s.acceptance_rate)
    plain = ServerMetrics(AsyncLLM(make(loaded("llama")).engine)).render().decode()
    assert "spec_decode" not in plain  # no speculation, no series


def test_generate_cli_flag():
    from click.testing import CliRunner

    from warpforge.cli import main

    path = checkpoint("llama")
    prompt = "To be, or not to be, to be, or not to be, to be"

    def run(*args):
        return CliRunner().invoke(main, ["generate", str(path), prompt, "--max-tokens", "16", "--max-model-len", "128",
                                         *args])

    plain, spec = run(), run("--speculative", "ngram", "--spec-k", "3")
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout.split("\n")[:-2] == plain.stdout.split("\n")[:-2]  # the same text
    assert "speculative ngram:" in spec.stdout.split("\n")[-2] and "accepted" in spec.stdout
    for args, says in ((["--speculative", "draft"], "speculative.draft_model: method 'draft' needs a draft model"),
                       (["--spec-k", "0", "--speculative", "self"], "speculative.k: expected an integer in [1, 32]"),
                       (["--speculative", "draft", "--draft-model", "/no/such"], "no such file or directory")):
        r = run(*args)
        err = r.stderr.split("\n", 1)[1] if r.stderr.startswith("loading ") else r.stderr  # found while loading
        assert r.exit_code == 2 and says in err and err.count("\n") == 1, r.output


def test_serve_config_takes_a_method():
    from warpforge.serve.config import ServeConfig

    assert ServeConfig(model="m", speculative="ngram").speculative == "ngram"
    with pytest.raises(ValueError, match=r"^speculative: expected None, 'ngram' or 'self', got 'draft'$"):
        ServeConfig(model="m", speculative="draft")



def test_drafter_cost_counts_quantized_layers_like_float_ones():
    """The adaptive rule's cost model counts the matrices a token multiplies through: a quantized layer
    (packed buffers, no float weight) counts its in x out features, as its float twin does."""
    from warpforge.llm.drafters import matmul_params
    from warpforge.llm.loader import load
    from warpforge.llm.quantize import quantize_model

    m = load(checkpoint("llama"), dtype=torch.float32, device="cpu")
    dense = matmul_params(m.model), matmul_params(m.model, 1)
    quantize_model(m.model, "int8", tokenizer=m.tokenizer)
    assert (matmul_params(m.model), matmul_params(m.model, 1)) == dense
    assert 0 < dense[1] < dense[0]
