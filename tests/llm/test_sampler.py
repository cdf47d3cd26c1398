"""Sampler: each feature against a per-row Python reference (HF / OpenAI semantics), greedy exactness,
filters, the sampled distribution, seeds independent of the batch, logprobs."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from warpforge.llm.sampler import Sampler, SamplingTensors, apply_penalties
from warpforge.llm.sampling import SamplingParams

V = 64
NEG = -math.inf


def softmax(x: list[float]) -> list[float]:
    m = max(x)
    e = [math.exp(v - m) if v != NEG else 0.0 for v in x]
    s = sum(e)
    return [v / s for v in e]


def reference_row(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int]):
    """(penalized logits, processed logits with -inf where filtered) of one row, straight from the specs."""
    x = list(logits)
    for t in set(prompt) | set(output):  # HF RepetitionPenaltyLogitsProcessor
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():  # OpenAI presence / frequency penalties
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    penalized = list(x)
    if p.greedy:
        return penalized, None
    y = [v / p.temperature for v in x]
    if p.top_k > 0:  # HF TopKLogitsWarper: keep >= the k-th largest
        kth = sorted(y, reverse=True)[min(p.top_k, len(y)) - 1]
        y = [v if v >= kth else NEG for v in y]
    if p.top_p < 1.0:  # HF TopPLogitsWarper: drop the least likely while their mass <= 1 - top_p
        probs, cum = softmax(y), 0.0
        for i in sorted(range(len(y)), key=lambda i: y[i])[:-1]:
            cum += probs[i]
            if cum > 1 - p.top_p:
                break
            y[i] = NEG
    if p.min_p > 0.0:  # HF MinPLogitsWarper
        probs = softmax(y)
        top = max(probs)
        y = [v if pr >= p.min_p * top else NEG for v, pr in zip(y, probs)]
    return penalized, y


def random_batch(rng: random.Random, B: int):
    params, prompts, outputs = [], [], []
    for _ in range(B):
        params.append(SamplingParams(
            temperature=rng.choice([0.0, 0.5, 1.0, 1.7]), top_k=rng.choice([-1, 0, 1, 5, 20, V + 3]),
            top_p=rng.choice([1.0, 0.9, 0.5, 0.1]), min_p=rng.choice([0.0, 0.05, 0.3]),
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]), presence_penalty=rng.choice([0.0, 0.7, -0.4]),
            frequency_penalty=rng.choice([0.0, 0.5, -1.0]), seed=rng.choice([None, rng.randrange(1000)]),
            logprobs=rng.choice([None, 0, 3])))
        prompts.append([rng.randrange(V) for _ in range(rng.randrange(1, 12))])
        outputs.append([rng.randrange(V) for _ in range(rng.randrange(0, 15))])
    return params, prompts, outputs


def test_processing_matches_per_row_reference(device):
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        params, prompts, outputs = random_batch(rng, 24)
        logits = torch.randn(24, V, generator=gen, dtype=torch.float64) * 3
        t = SamplingTensors.from_params(params, prompts, outputs, V, device)
        pen = apply_penalties(logits.float().to(device), t)
        proc = Sampler().processed_logits(pen, t).cpu().double()
        for i, p in enumerate(params):
            want_pen, want = reference_row(logits[i].tolist(), p, prompts[i], outputs[i])
            torch.testing.assert_close(pen[i].cpu().double(), torch.tensor(want_pen, dtype=torch.float64),
                                       rtol=1e-5, atol=1e-5)
            if p.greedy:
                continue  # greedy rows never use the processed logits
            want = torch.tensor(want, dtype=torch.float64)
            assert torch.equal(torch.isfinite(proc[i]), torch.isfinite(want)), f"row {i}: {p}"
            keep = torch.isfinite(want)
            torch.testing.assert_close(proc[i][keep], want[keep], rtol=1e-5, atol=1e-5)


def test_samples_stay_in_the_allowed_set_and_greedy_is_exact_argmax(device):
    rng = random.Random(1)
    params, prompts, outputs = random_batch(rng, 32)
    logits = torch.randn(32, V, generator=torch.Generator().manual_seed(1)) * 3
    refs = [reference_row(logits[i].double().tolist(), p, prompts[i], outputs[i]) for i, p in enumerate(params)]
    sampler = Sampler(seed=3)
    for _ in range(20):
        t = SamplingTensors.from_params(params, prompts, outputs, V, device)
        ids = sampler(logits.to(device), t).token_ids.tolist()
        for i, (p, (pen, proc)) in enumerate(zip(params, refs)):
            if p.greedy:
                assert ids[i] == max(range(V), key=lambda v: pen[v])
            else:
                assert proc[ids[i]] != NEG, f"row {i} sampled a filtered token"


def test_top_k_1_equals_greedy(device):
    logits = torch.randn(40, V, generator=torch.Generator().manual_seed(2)) * 2
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i if i % 2 else None) for i in range(40)]
    t = SamplingTensors.from_params(params, [[1]] * 40, [[]] * 40, V, device)
    out = Sampler()(logits.to(device), t)
    assert torch.equal(out.token_ids.cpu(), logits.argmax(dim=-1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=4),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=1.0),
])
def test_sampled_distribution_matches_reference(device, params):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    n = 20000
    _, proc = reference_row(logits.double().tolist(), params, [], [])
    want = softmax(proc)
    t = SamplingTensors.from_params([params] * n, [[]] * n, [[]] * n, 6, device)
    ids = Sampler(seed=0)(logits.expand(n, 6).contiguous().to(device), t).token_ids.cpu()
    got = torch.bincount(ids, minlength=6).double() / n
    assert (got - torch.tensor(want)).abs().max() < 0.02, (got.tolist(), want)  # ~6 sigma at n = 20000
    assert all(got[i] == 0 for i in range(6) if want[i] == 0)


def test_seeded_rows_ignore_batch_mates_and_sampler_seed(device):
    logits = torch.zeros(5, V)  # flat: every token equally likely, so the seed alone decides
    seeded = SamplingParams(temperature=1.0, seed=42)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3)]

    def run(rows, sampler_seed, output_len=3):
        params = [r[0] for r in rows]
        t = SamplingTensors.from_params(params, [[1, 2]] * len(rows), [[r[1]] * output_len for r in rows], V, device)
        return Sampler(seed=sampler_seed)(logits[:len(rows)].to(device), t).token_ids.tolist()

    a = run([(seeded, 1), (others[0], 2)], 0)[0]
    b = run([(others[1], 3), (others[0], 4), (seeded, 1)], 9)[2]
    assert a == b
    tokens = {run([(seeded, 1)], 0, output_len=k)[0] for k in range(10)}
    assert len(tokens) > 3  # the stream moves on with the output position


def test_unseeded_rows_follow_the_sampler_seed(device):
    logits = torch.zeros(16, V)
    t = SamplingTensors.from_params([SamplingParams()] * 16, [[1]] * 16, [[]] * 16, V, device)
    a, b, c = Sampler(seed=5), Sampler(seed=5), Sampler(seed=6)
    ra = [a(logits.to(device), t).token_ids.tolist() for _ in range(2)]
    rb = [b(logits.to(device), t).token_ids.tolist() for _ in range(2)]
    rc = [c(logits.to(device), t).token_ids.tolist() for _ in range(2)]
    assert ra == rb and ra != rc and ra[0] != ra[1]


def test_logprobs_chosen_and_top_n(device):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 2
    params = [SamplingParams(temperature=0.5, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7, top_k=2, logprobs=5)]
    prompts, outputs = [[1, 2], [3], [4], [5]], [[6], [], [7], []]
    t = SamplingTensors.from_params(params, prompts, outputs, V, device)
    out = Sampler()(logits.to(device), t)
    pen = torch.tensor([reference_row(logits[i].double().tolist(), p, prompts[i], outputs[i])[0]
                        for i, p in enumerate(params)], dtype=torch.float64)
    lp = pen.log_softmax(dim=-1)  # after penalties, before temperature and filters
    ids = out.token_ids.cpu()
    torch.testing.assert_close(out.logprobs.cpu().double(), lp.gather(1, ids[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    assert out.top_ids.shape == (4, 5)
    ids_list, dicts = out.to_lists(t.num_logprobs)
    assert ids_list == ids.tolist() and dicts[2] is None
    assert list(dicts[1]) == [ids_list[1]] and ids_list[1] == int(pen[1].argmax())
    for row, n in ((0, 3), (3, 5)):
        top = lp[row].topk(n)
        want = {ids_list[row]: float(lp[row, ids_list[row]])} | dict(zip(top.indices.tolist(), top.values.tolist()))
        assert dicts[row].keys() == want.keys() and next(iter(dicts[row])) == ids_list[row]
        for k, v in want.items():
            assert math.isclose(dicts[row][k], v, rel_tol=1e-5, abs_tol=1e-5)
    no_lp = Sampler()(logits.to(device), SamplingTensors.from_params([SamplingParams()] * 4, prompts, outputs, V,
                                                                    device))
    assert no_lp.logprobs is None and no_lp.to_lists([None] * 4)[1] == [None] * 4


def test_all_greedy_batch_and_shape_check(device):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    t = SamplingTensors.from_params([SamplingParams(temperature=0)] * 3, [[1]] * 3, [[]] * 3, V, device)
    assert t.all_greedy and t.top_k is None and t.seen_ids is None
    assert torch.equal(Sampler()(logits.to(device), t).token_ids.cpu(), logits.argmax(-1))
    with pytest.raises(ValueError, match="logits"):
        Sampler()(torch.randn(4, V, device=device), t)
