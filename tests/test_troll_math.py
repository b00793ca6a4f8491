"""TROLL's math layer (verl_dppo.math.troll) against independent float64 references.

- the projection (their Eq. 3/4): feasible, the minimiser of KL(p || pi) on the ball (a generic penalty solver and a
  dense simplex grid), the identity inside the ball;
- the per-token pieces from logits and the rollout's top-K: a row-by-row float64 re-implementation of the support,
  the coarsening to S U {other}, mu outside its reported top-K, and Eq. 5's pieces;
- gradients: gradcheck through the projection (implicit eta), the stop-gradient regression term against the
  numerical derivative with its target frozen, and a detached eta giving a different (wrong) gradient;
- numbers where models live (peaked rows, bf16 logits, log-probs down to -100), chunking, what autograd saves,
  the in-place backward and its guard, masks, bad input.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from verl_dppo.math import troll
from verl_dppo.math.troll import (
    TrollInputError,
    kl_projection,
    troll_token_loss,
    troll_token_terms,
)


def test_paper_values_and_no_verl_import():
    assert (troll.EPS, troll.ALPHA, troll.SUPPORT_MASS, troll.TOPK) == (0.05, 1.0, 1.0 - 1e-5, 64)
    code = "import sys, verl_dppo.math.troll; assert 'verl' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the projection on atoms ---------------------------------------------------------------------------------------


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (p.log() - q.log())).sum(-1)


def random_atoms(rows: int, atoms: int, seed: int, spread: float = 2.0, noise: float = 1.5):
    gen = torch.Generator().manual_seed(seed)
    log_pi = torch.log_softmax(torch.randn(rows, atoms, generator=gen, dtype=torch.float64) * spread, -1)
    scale = noise * torch.linspace(0.02, 1.0, rows, dtype=torch.float64)[:, None]  # inside and outside the ball
    log_mu = torch.log_softmax(log_pi + scale * torch.randn(rows, atoms, generator=gen, dtype=torch.float64), -1)
    return log_pi, log_mu


def penalty_solver(log_pi: torch.Tensor, log_mu: torch.Tensor, eps: float) -> torch.Tensor:
    """A generic solver of min KL(p || pi) s.t. KL(p || mu) <= eps: L-BFGS on softmax(theta) with a growing
    quadratic penalty, started at mu (feasible). Knows nothing of the closed form."""
    theta = log_mu.clone().requires_grad_()
    for rho in (1e2, 1e5, 1e8, 1e10):
        opt = torch.optim.LBFGS(
            [theta], max_iter=500, tolerance_grad=1e-15, tolerance_change=1e-18, line_search_fn="strong_wolfe"
        )

        def closure():
            opt.zero_grad()
            log_p = torch.log_softmax(theta, -1)
            p = log_p.exp()
            objective = (p * (log_p - log_pi)).sum() + rho * torch.relu((p * (log_p - log_mu)).sum() - eps) ** 2
            objective.backward()
            return objective

        opt.step(closure)
    return torch.softmax(theta.detach(), -1)


@pytest.mark.parametrize("atoms", [3, 8, 20])
def test_projection_is_feasible_and_the_minimiser_eq3(atoms):
    log_pi, log_mu = random_atoms(6, atoms, seed=atoms)
    eps = 0.05
    result = kl_projection(log_pi, log_mu, eps)
    p, pi, mu = result.log_p.exp(), log_pi.exp(), log_mu.exp()
    torch.testing.assert_close(p.sum(-1), torch.ones(6, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool(result.projected.any()) and bool((~result.projected).any())  # both kinds of rows
    assert bool((kl(p, mu) <= eps + 1e-6).all())
    for row in range(6):
        if not result.projected[row]:
            continue
        assert kl(p[row], mu[row]).item() == pytest.approx(eps, abs=1e-9)  # the constraint is active
        brute = penalty_solver(log_pi[row], log_mu[row], eps)
        assert kl(brute, mu[row]).item() <= eps + 1e-6
        assert kl(p[row], pi[row]).item() <= kl(brute, pi[row]).item() + 1e-7
        torch.testing.assert_close(p[row], brute, rtol=0, atol=2e-4)


def test_projection_beats_every_feasible_point_of_a_dense_simplex_grid():
    log_pi = torch.log(torch.tensor([[0.7, 0.2, 0.1]], dtype=torch.float64))
    log_mu = torch.log(torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64))
    eps = 0.05
    result = kl_projection(log_pi, log_mu, eps)
    assert bool(result.projected[0])
    steps = 1500
    grid = torch.arange(1, steps, dtype=torch.float64) / steps
    a, b = torch.meshgrid(grid, grid, indexing="ij")
    points = torch.stack([a, b, 1 - a - b], -1).reshape(-1, 3)
    points = points[points[:, 2] > 0]
    feasible = points[kl(points, log_mu.exp()) <= eps]
    ours = kl(result.log_p.exp(), log_pi.exp()).item()
    grid_best = kl(feasible, log_pi.exp()).min().item()
    assert ours <= grid_best + 1e-12
    assert grid_best - ours < 5e-4  # the grid is 1/1500 fine


def test_identity_inside_the_ball():
    log_pi, log_mu = random_atoms(8, 10, seed=1, noise=0.05)
    result = kl_projection(log_pi, log_mu, 0.05)
    assert not bool(result.projected.any())
    assert bool((result.eta == 0).all())
    torch.testing.assert_close(result.log_p, log_pi, rtol=0, atol=1e-14)
    torch.testing.assert_close(result.kl_after, result.kl_before, rtol=0, atol=1e-15)


def test_projection_reaches_far_rows_and_zero_mass_atoms():
    """KL(pi || mu) of tens of nats (log-probs down to -100), atoms where pi = 0 (log pi = -inf), and the one case
    without a root (pi = 0 where mu holds more than 1 - e^-eps): the bracket's end, finite."""
    log_pi = torch.log_softmax(torch.tensor([[0.0, -100.0, -100.0, -3.0], [0.0, -1.0, -2.0, -3.0]] * 2), -1).double()
    log_pi[1:, 3] = -math.inf
    log_mu = torch.log_softmax(
        torch.tensor([[-100.0, 0.0, -2.0, -1.0], [-3.0, 0.0, -1.0, -6.0], [-3.0, 0.0, -1.0, -6.0], [-3, 0, -1, 2.0]]),
        -1,
    ).double()
    result = kl_projection(log_pi, log_mu, 0.05)
    assert bool(result.projected.all()) and result.kl_before[0] > 50
    assert bool(torch.isfinite(result.eta).all()) and bool(torch.isfinite(result.kl_after).all())
    torch.testing.assert_close(result.kl_after[:3], torch.full((3,), 0.05, dtype=torch.float64), rtol=0, atol=1e-9)
    assert bool((result.log_p[1:, 3] == -math.inf).all())
    unreachable = -math.log(1 - log_mu[3, 3].exp().item())  # KL(mu restricted to pi's support || mu)
    assert result.eta[3].item() == pytest.approx(math.exp(troll.LOG_ETA_BRACKET[1]))
    assert result.kl_after[3].item() == pytest.approx(unreachable, rel=1e-6)


def test_projection_gradient_is_the_implicit_derivative_and_not_the_detached_one():
    """gradcheck through eta; p_eta with eta detached (prime-rl's choice) has a different gradient."""
    log_pi, log_mu = random_atoms(4, 6, seed=7, noise=5.0)
    assert kl_projection(log_pi, log_mu).projected.tolist() == [False, True, True, True]
    weights = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def objective(x):
        return (kl_projection(x, log_mu).log_p * weights).sum(-1)

    torch.autograd.gradcheck(objective, (log_pi.clone().requires_grad_(),))
    x = log_pi.clone().requires_grad_()
    (ours,) = torch.autograd.grad(objective(x).sum(), x)
    x = log_pi.clone().requires_grad_()
    eta = kl_projection(x, log_mu).eta.detach()[:, None]
    z = (x + eta * log_mu) / (1 + eta)
    (detached,) = torch.autograd.grad((torch.log_softmax(z, -1) * weights).sum(), x)
    assert (ours - detached).abs().max() > 1e-2


# --- the per-token pieces from logits and the rollout's top-K ------------------------------------------------------

MASS, TOPK, EPS = 0.99, 4, 0.05


def make_case(
    rows: int, vocab: int, reported: int, seed: int, noise: float = 1.5, dtype=torch.float64, tied: bool = False
):
    """pi's logits, mu = pi + noise growing over the rows, the engine's top-`reported` (shuffled), a_t ~ mu.
    tied: pi's logits and mu's noise on a coarse grid, so that both hold many ties (bf16 logits over a real
    vocabulary do), at the top-k boundary and at the mass boundary alike."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    noise_draw = torch.randn(rows, vocab, generator=gen)
    if tied:
        logits, noise_draw = logits.round(), noise_draw.round()
    logits = logits.to(dtype)
    scale = noise * torch.linspace(0.02, 1.0, rows, dtype=torch.float64)[:, None]  # inside and outside the ball
    if tied:
        scale = scale.round().clamp(min=0.0)
    mu_logp = torch.log_softmax(logits.double() + scale * noise_draw, -1)
    topk_lp, topk_ids = mu_logp.topk(reported, dim=-1)
    sampled = torch.multinomial(mu_logp.exp(), 1, generator=gen).squeeze(1)
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    perm = torch.argsort(torch.rand(rows, reported, generator=gen), -1)  # the engine's order must not matter
    return logits, topk_ids.gather(1, perm), topk_lp.gather(1, perm), sampled, sampled_lp


def reference_row(logits, topk_ids, topk_lp, sampled, sampled_lp, eps=EPS, mass=MASS, k=TOPK):
    """One token, from the text of the method, in float64 with python loops."""
    vocab = logits.numel()
    pi = torch.softmax(logits.double(), -1)

    def top(tokens_and_probs):
        """The most likely tokens until their mass reaches `mass`, at most k, in whole groups of equal probability:
        a group is in when the mass strictly above it is below `mass` and at most k tokens are at or above it."""
        return [
            token
            for token, prob in tokens_and_probs
            if sum(p for _, p in tokens_and_probs if p > prob) < mass
            and sum(1 for _, p in tokens_and_probs if p >= prob) <= k
        ]

    reported = {int(i): float(lp) for i, lp in zip(topk_ids, topk_lp) if math.isfinite(float(lp))}
    mu_top = top(sorted(((i, math.exp(lp)) for i, lp in reported.items()), key=lambda t: -t[1]))
    pi_top = top([(int(i), float(pi[i])) for i in torch.argsort(pi, descending=True)])
    support = sorted(set(mu_top) | {sampled} | set(pi_top))

    unreported_mass = 1.0 - sum(math.exp(lp) for lp in reported.values())
    unreported_count = vocab - len(reported)
    if sampled not in reported:
        unreported_mass -= math.exp(sampled_lp)
        unreported_count -= 1
    share = min(max(unreported_mass, 0.0) / max(unreported_count, 1), min(math.exp(v) for v in reported.values()))
    share = max(share, troll.MU_FLOOR)  # per atom
    mu_s = [
        math.exp(sampled_lp) if x == sampled else math.exp(reported[x]) if x in reported else share for x in support
    ]
    mu_atoms = torch.tensor(mu_s + [max(1.0 - sum(mu_s), troll.MU_FLOOR)], dtype=torch.float64)
    mu_atoms = mu_atoms / mu_atoms.sum()
    tail = [x for x in range(vocab) if x not in set(support)]
    pi_atoms = torch.cat([pi[support], pi[tail].sum().reshape(1)])
    present = pi_atoms > 0

    def project(eta):
        z = torch.where(present, (pi_atoms.log() + eta * mu_atoms.log()) / (1 + eta), -math.inf)
        return torch.softmax(z, -1)

    def kl_to_mu(p):
        return sum(float(a * math.log(a / b)) for a, b in zip(p, mu_atoms) if a > 0)

    kl_before = kl_to_mu(pi_atoms)
    eta = 0.0
    if kl_before > eps:
        lo, hi = -25.0, 25.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if kl_to_mu(project(math.exp(mid))) > eps else (lo, mid)
        eta = math.exp(hi)
    p = project(eta)
    slot = support.index(sampled)
    regression = sum(float(a * math.log(a / b)) for a, b in zip(pi_atoms, p) if a > 0)
    return {
        "log_p_sampled": math.log(p[slot]),
        "regression_kl": regression,
        "log_mu_sampled": math.log(mu_atoms[slot]),
        "eta": eta,
        "kl_before": kl_before,
        "kl_after": kl_to_mu(p),
        "support_size": len(support),
        "p": p,
        "support": support,
    }


@pytest.mark.parametrize("seed,tied", [(0, False), (1, False), (2, False), (3, False), (4, True), (5, True)])
def test_terms_match_the_float64_reference(seed, tied):
    logits, ids, lps, sampled, sampled_lp = make_case(12, 30, reported=6, seed=seed, tied=tied)
    terms = troll_token_terms(logits, ids, lps, sampled, sampled_lp, eps=EPS, support_mass=MASS, topk=TOPK)
    projected = terms.diagnostics["projected"]
    assert bool(projected.any()) and bool((~projected).any())
    for row in range(12):
        ref = reference_row(logits[row], ids[row], lps[row], int(sampled[row]), float(sampled_lp[row]))
        assert terms.diagnostics["support_size"][row].item() == ref["support_size"]
        assert bool(projected[row]) == (ref["eta"] > 0)
        for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
            assert getattr(terms, name)[row].item() == pytest.approx(ref[name], rel=1e-9, abs=1e-11), name
        for name in ("eta", "kl_before", "kl_after"):  # float32 diagnostics
            assert terms.diagnostics[name][row].item() == pytest.approx(ref[name], rel=1e-5, abs=1e-7), name
        assert terms.diagnostics["kl_after"][row].item() <= EPS + 1e-6


def test_support_counts_each_token_once_and_prices_unreported_tokens():
    """a_t inside and outside mu's report, pi's top tokens outside it (mu unknown there), paper's mass rule."""
    logits, ids, lps, sampled, sampled_lp = make_case(40, 50, reported=5, seed=11, noise=3.0)
    terms = troll_token_terms(logits, ids, lps, sampled, sampled_lp, topk=TOPK, support_mass=MASS)
    inside = (ids == sampled[:, None]).any(-1)
    assert bool(inside.any()) and bool((~inside).any())
    unpriced = 0
    for row in range(40):
        ref = reference_row(logits[row], ids[row], lps[row], int(sampled[row]), float(sampled_lp[row]))
        unpriced += len(set(ref["support"]) - set(ids[row].tolist()) - {int(sampled[row])})
        assert terms.diagnostics["support_size"][row].item() == ref["support_size"]
        assert terms.log_p_sampled[row].item() == pytest.approx(ref["log_p_sampled"], rel=1e-9, abs=1e-11)
    assert unpriced > 0  # the unreported-share rule was exercised


def test_the_floor_is_per_atom_on_a_qwen_sized_row():
    """MU_FLOOR floors each atom mu' has no report for (the authors' tiny probability per token), after the
    unreported mass is divided among the unreported tokens; not that mass before the division (a floor of
    1e-12 / 151,933 = 6.6e-18 per token, which depends on the vocabulary).

    One row, V = 151,936, by hand in float64: mu reports tokens 0, 1, 2 at 0.5, 0.3, 0.2 - 5e-12 (a_t = 0), so the
    unreported mass is 5e-12, 3.3e-17 per token. pi: logits 0.5 (token 5), 0 (token 0), -30 elsewhere, so
    Top(pi) = {5, 0} and S = {0, 1, 2, 5}. mu'(5) = max(min(3.3e-17, 0.2 - 5e-12), 1e-12) = 1e-12 and
    mu'(other) = 1 - (1 - 5e-12 + 1e-12) = 4e-12: the atoms sum to 1. KL(pi' || mu') = 16.8 nats; the total-mass
    floor would give mu'(5) = 5e-12 / 151,933 and 23.2 nats. Row 1 adds a reported token at 1e-14: the floor
    is applied last, so mu'(5) stays 1e-12 (19.7 nats if the cap at the smallest reported probability won).
    """
    vocab = 151_936
    logits = torch.full((2, vocab), -30.0, dtype=torch.float64)
    logits[:, 5], logits[:, 0] = 0.5, 0.0
    ids = torch.tensor([[2, 0, 1, 7], [2, 0, 1, 3]])
    lps = torch.tensor([math.log(0.2 - 5e-12), math.log(0.5), math.log(0.3), -math.inf], dtype=torch.float64)
    lps = torch.stack([lps, lps.clone()])
    lps[1, 3] = math.log(1e-14)  # row 1: a reported 1e-14 caps the share below the floor: the floor wins
    sampled_lp = torch.full((2,), math.log(0.5), dtype=torch.float64)
    terms = troll_token_terms(logits, ids, lps, torch.tensor([0, 0]), sampled_lp)
    assert terms.diagnostics["support_size"].tolist() == [4, 4]

    z = math.exp(0.5) + 1.0 + (vocab - 2) * math.exp(-30.0)
    pi = {0: 1.0 / z, 1: math.exp(-30.0) / z, 2: math.exp(-30.0) / z, 5: math.exp(0.5) / z}
    pi_other = (vocab - 5) * math.exp(-30.0) / z

    def kl_before(mu5, mu_other):
        mu = {0: 0.5, 1: 0.3, 2: 0.2 - 5e-12, 5: mu5}
        total = sum(mu.values()) + mu_other
        terms_ = [pi[i] * math.log(pi[i] / (mu[i] / total)) for i in pi]
        return sum(terms_) + pi_other * math.log(pi_other / (mu_other / total))

    per_atom = kl_before(1e-12, 4e-12)
    shared = 5e-12 / (vocab - 3)
    total_mass = kl_before(shared, 5e-12 - shared)
    assert per_atom == pytest.approx(16.798, abs=1e-3) and total_mass == pytest.approx(23.223, abs=1e-3)
    # Row 1 is row 0 with token 3 reported at 1e-14 (in "other" either way): mu'(5) = 1e-12 again, not 1e-14.
    assert kl_before(1e-14, 5e-12 - 1e-14) == pytest.approx(19.66, abs=1e-2)
    assert terms.diagnostics["kl_before"].tolist() == pytest.approx([per_atom, per_atom], rel=1e-6)


def frozen_regression(logits, targets):
    """sum over rows of KL(pi'(logits) || p0) with p0 fixed on fixed atoms: what the stop-gradient term
    differentiates. targets: per row (support, p0 on support U {other})."""
    total = 0.0
    for row, (support, p0) in enumerate(targets):
        pi = torch.softmax(logits[row], -1)
        tail = [x for x in range(logits.shape[1]) if x not in set(support)]
        pi_atoms = torch.cat([pi[support], pi[tail].sum().reshape(1)])
        total = total + (pi_atoms * (pi_atoms.log() - p0.log())).sum()
    return total


def test_gradcheck_of_the_per_token_loss_through_the_projection():
    """Eq. 5 with alpha = 0 by gradcheck (inside and outside the ball, implicit eta); the regression term's gradient
    against central differences of KL(pi' || p0) with p0 frozen (a stop-gradient is not a function to gradcheck)."""
    logits, ids, lps, sampled, sampled_lp = make_case(6, 16, reported=5, seed=3)
    advantages = torch.tensor([1.0, -0.5, 2.0, -1.0, 0.3, 1.5], dtype=torch.float64)

    def policy_term(x):
        terms = troll_token_terms(x, ids, lps, sampled, sampled_lp, eps=EPS, support_mass=MASS, topk=TOPK)
        return troll_token_loss(terms, advantages, alpha=0.0)

    projected = troll_token_terms(logits, ids, lps, sampled, sampled_lp, support_mass=MASS, topk=TOPK)
    assert bool(projected.diagnostics["projected"].any()) and bool((~projected.diagnostics["projected"]).any())
    torch.autograd.gradcheck(policy_term, (logits.clone().requires_grad_(),))

    x = logits.clone().requires_grad_()
    terms = troll_token_terms(x, ids, lps, sampled, sampled_lp, eps=EPS, support_mass=MASS, topk=TOPK)
    loss = troll_token_loss(terms, advantages, alpha=1.0)
    (ours,) = torch.autograd.grad(terms.regression_kl.sum(), x, retain_graph=True)
    (total,) = torch.autograd.grad(loss.sum(), x)
    targets = []
    for row in range(6):
        ref = reference_row(logits[row], ids[row], lps[row], int(sampled[row]), float(sampled_lp[row]))
        targets.append((ref["support"], ref["p"]))
    numerical = torch.zeros_like(logits)
    h = 1e-6
    for index in range(logits.numel()):
        up, down = logits.clone().view(-1), logits.clone().view(-1)
        up[index] += h
        down[index] -= h
        plus = frozen_regression(up.view_as(logits), targets)
        minus = frozen_regression(down.view_as(logits), targets)
        numerical.view(-1)[index] = (plus - minus) / (2 * h)
    torch.testing.assert_close(ours, numerical, rtol=1e-5, atol=1e-8)
    x2 = logits.clone().requires_grad_()
    (policy_grad,) = torch.autograd.grad(policy_term(x2).sum(), x2)
    torch.testing.assert_close(total, policy_grad + ours, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_the_paper_support_rule():
    """The paper's 1 - 1e-5 / K = 64 on a small vocabulary: the support holds nearly every token."""
    logits, ids, lps, sampled, sampled_lp = make_case(5, 12, reported=8, seed=12)
    advantages = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7], dtype=torch.float64)

    def policy_term(x):
        return troll_token_loss(troll_token_terms(x, ids, lps, sampled, sampled_lp), advantages, alpha=0.0)

    projected = troll_token_terms(logits, ids, lps, sampled, sampled_lp).diagnostics["projected"]
    assert bool(projected.any()) and bool((~projected).any())
    torch.autograd.gradcheck(policy_term, (logits.clone().requires_grad_(),))


def peaked_case(dtype):
    """Rows with top-1 probability 1 - 1e-9 under pi, mu elsewhere, log-probs down to -100, and flat rows."""
    rows, vocab, reported = 6, 40, 8
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    peak = math.log((vocab - 1) / 1e-9)  # softmax: top-1 = 1 - 1e-9 over a flat rest
    logits[:3] = 0.0
    logits[:3, 0] = peak
    mu_logp = torch.log_softmax(torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3, -1)
    mu_logp[0] = torch.log_softmax(logits[0], -1)  # mu = pi: inside the ball
    mu_logp[1] = -100.0  # mu puts everything on token 1, pi's mode gets e^-100
    mu_logp[1, 1] = 0.0
    mu_logp[1] = torch.log_softmax(mu_logp[1], -1)
    topk_lp, topk_ids = mu_logp.topk(reported, -1)
    sampled = torch.tensor([0, 0, 3, 5, 7, 9])
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)  # row 1: log mu(a_t) = -100
    return logits.to(dtype), topk_ids, topk_lp.float(), sampled, sampled_lp.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_peaked_rows_bf16_and_logprobs_down_to_minus_100_stay_finite(dtype):
    logits, ids, lps, sampled, sampled_lp = peaked_case(dtype)
    assert sampled_lp[1].item() == pytest.approx(-100.0, abs=1e-3)
    x = logits.clone().requires_grad_()
    terms = troll_token_terms(x, ids, lps, sampled, sampled_lp)
    loss = troll_token_loss(terms, torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0]))
    (grad,) = torch.autograd.grad(loss.sum(), x)
    for value in (terms.log_p_sampled, terms.regression_kl, terms.log_mu_sampled, loss, grad.float()):
        assert bool(torch.isfinite(value).all())
    assert not bool(terms.diagnostics["projected"][0]) and bool(terms.diagnostics["projected"][1])
    assert terms.diagnostics["kl_before"][1] > 50
    assert bool((terms.diagnostics["kl_after"] <= 0.05 + 1e-6).all())
    assert terms.diagnostics["support_size"][0].item() == 1  # pi = mu, both have one token above 1 - 1e-5
    # float32 on the full vocabulary: pi(other) = 1e-9 is kept exactly (not 1 - 0.999999999 in float32).
    if dtype != torch.bfloat16:
        assert terms.regression_kl[0].item() == pytest.approx(0.0, abs=1e-12)


def test_chunk_size_does_not_change_results_or_gradients():
    logits, ids, lps, sampled, sampled_lp = make_case(23, 50, reported=6, seed=9, dtype=torch.bfloat16)
    advantages = torch.randn(23, generator=torch.Generator().manual_seed(1))
    results = []
    for chunk_bytes in (1, 7 * 50 * 4, 2**30):
        x = logits.clone().requires_grad_()
        terms = troll_token_terms(x, ids, lps.float(), sampled, sampled_lp.float(), chunk_bytes=chunk_bytes, topk=8)
        (grad,) = torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)
        results.append((terms.log_p_sampled, terms.regression_kl, terms.diagnostics["eta"], grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_autograd_saves_no_float32_vocabulary_sized_tensor(dtype):
    """Only the logits themselves (no copy) and [N, |S|]-sized tensors are kept for backward."""
    rows, vocab = 64, 3000
    logits, ids, lps, sampled, sampled_lp = make_case(rows, vocab, reported=16, seed=2, dtype=dtype)
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype, t.data_ptr()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        terms = troll_token_terms(x, ids, lps.float(), sampled, sampled_lp.float(), chunk_bytes=8 * vocab * 4)
        loss = troll_token_loss(terms, torch.ones(rows)).sum()
    big = [s for s in saved if math.prod(s[0]) > rows * vocab // 8]
    assert big and all(s == ((rows, vocab), dtype, x.data_ptr()) for s in big), big
    width = terms.diagnostics["support_size"].max().item() + 1  # |S| + "other"
    assert all(math.prod(s[0]) <= rows * width for s in saved if s[2] != x.data_ptr())
    loss.backward()
    assert bool(torch.isfinite(x.grad.float()).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("masked", [False, True])
def test_inplace_backward_writes_the_same_gradient_into_the_logits(dtype, masked):
    logits, ids, lps, sampled, sampled_lp = make_case(20, 60, reported=6, seed=4, dtype=dtype)
    mask = torch.arange(20) % 3 != 0 if masked else None
    advantages = torch.randn(20, generator=torch.Generator().manual_seed(2))
    grads = []
    for inplace in (False, True):
        x = logits.clone().requires_grad_()
        terms = troll_token_terms(x, ids, lps.float(), sampled, sampled_lp.float(), mask, inplace_backward=inplace)
        (grad,) = torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)
        assert (grad.data_ptr() == x.data_ptr()) == inplace
        grads.append(grad.clone())
    assert torch.equal(grads[0], grads[1])
    if masked:
        assert bool((grads[0][~mask] == 0).all())


def test_backward_refuses_logits_overwritten_since_the_forward():
    logits, ids, lps, sampled, sampled_lp = make_case(8, 40, reported=6, seed=6, dtype=torch.float32)
    x = logits.clone().requires_grad_()
    loss = troll_token_loss(troll_token_terms(x, ids, lps.float(), sampled, sampled_lp.float()), torch.ones(8)).sum()
    x.data.mul_(0.5)  # what a Triton kernel writing into the storage does: no version-counter bump
    with pytest.raises(RuntimeError, match="logits changed since its forward"):
        loss.backward()
    x = logits.clone().requires_grad_()
    y = x * 1.0
    loss = troll_token_loss(troll_token_terms(y, ids, lps.float(), sampled, sampled_lp.float()), torch.ones(8)).sum()
    with torch.no_grad():
        y.add_(1.0)  # an in-place torch op: torch's own version check fires
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_masked_and_dropped_rows_are_zero_and_the_rest_unchanged():
    logits, ids, lps, sampled, sampled_lp = make_case(10, 40, reported=6, seed=8, dtype=torch.float32)
    lps, sampled_lp = lps.float(), sampled_lp.float()
    mask = torch.ones(10, dtype=torch.bool)
    mask[2] = False
    dropped_lp = sampled_lp.clone()
    dropped_lp[5] = float("nan")
    ids_bad = ids.clone()
    ids_bad[2] = 0  # a masked row is neither read nor validated
    x = logits.clone().requires_grad_()
    terms = troll_token_terms(x, ids_bad, lps, sampled, dropped_lp, mask)
    (grad,) = torch.autograd.grad(troll_token_loss(terms, torch.ones(10)).sum(), x)
    full = troll_token_terms(logits, ids, lps, sampled, sampled_lp)
    keep = torch.tensor([r not in (2, 5) for r in range(10)])
    assert terms.diagnostics["valid"].tolist() == keep.tolist()
    for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
        assert bool((getattr(terms, name)[~keep] == 0).all())
        torch.testing.assert_close(getattr(terms, name)[keep], getattr(full, name)[keep].detach())
    assert bool((grad[~keep] == 0).all()) and bool((grad[keep] != 0).any())
    nothing = troll_token_terms(x, ids, lps, sampled, sampled_lp, torch.zeros(10, dtype=torch.bool))
    assert bool((nothing.log_p_sampled == 0).all()) and not bool(nothing.diagnostics["valid"].any())


def test_a_row_with_a_nan_or_inf_logit_answers_nan_as_topk_does():
    """Issue 53.2: a row in the update whose logits hold a NaN or +inf, or are -inf throughout, has no pi: its log
    p(a_t), regression KL, eta, kl_before, kl_after and loss are NaN, where Top-K's D is NaN on the same input (they
    read 0 before, only the gradient NaN). A masked-out row of NaN is not read (0, as Top-K's); the other rows keep
    their values, and a -inf logit beside finite ones is probability 0, no error."""
    from verl_dppo.math.topk import topk_divergence

    logits, ids, lps, sampled, sampled_lp = make_case(8, 40, reported=6, seed=5, dtype=torch.float32)
    lps, sampled_lp = lps.float(), sampled_lp.float()
    bad = logits.clone()
    bad[1, 7], bad[2, 11], bad[3], bad[5] = math.nan, math.inf, -math.inf, math.nan
    bad[6, (int(sampled[6]) + 1) % 40] = -math.inf  # not a_t: probability 0 beside finite logits
    mask = torch.ones(8, dtype=torch.bool)
    mask[5] = False
    x = bad.clone().requires_grad_()
    terms = troll_token_terms(x, ids, lps, sampled, sampled_lp, mask)
    loss = troll_token_loss(terms, torch.ones(8))
    _, topk_kl = topk_divergence(bad, ids, lps, sampled, sampled_lp, mask)
    values = {
        "loss": loss,
        "log_p_sampled": terms.log_p_sampled,
        "regression_kl": terms.regression_kl,
        **{name: terms.diagnostics[name] for name in ("eta", "kl_before", "kl_after")},
    }
    no_pi = torch.tensor([r in (1, 2, 3) for r in range(8)])
    assert torch.isnan(topk_kl).tolist() == no_pi.tolist()
    for name, value in values.items():
        assert torch.isnan(value).tolist() == no_pi.tolist(), (name, value)
        assert float(value[5].detach()) == 0.0, name  # masked out: not read
    clean = troll_token_terms(logits, ids, lps, sampled, sampled_lp, mask)
    keep = ~no_pi & mask
    keep[6] = False  # its -inf logit moves its normaliser: finite, checked alone
    for name in ("log_p_sampled", "regression_kl"):
        torch.testing.assert_close(getattr(terms, name)[keep], getattr(clean, name)[keep].detach())
    assert bool(torch.isfinite(loss[6].detach())) and bool(terms.diagnostics["valid"][[1, 2, 3]].all())


def test_bad_input_names_the_problem():
    logits, ids, lps, sampled, sampled_lp = make_case(4, 20, reported=5, seed=0, dtype=torch.float32)
    lps, sampled_lp = lps.float(), sampled_lp.float()
    repeated = ids.clone()
    repeated[1, 1] = repeated[1, 0]
    with pytest.raises(TrollInputError, match="repeat a token id"):
        troll_token_terms(logits, repeated, lps, sampled, sampled_lp)
    with pytest.raises(TrollInputError, match="outside the vocabulary"):
        troll_token_terms(logits, ids + 20, lps, sampled, sampled_lp)
    nan = lps.clone()
    nan[0, 0] = float("nan")
    with pytest.raises(TrollInputError, match="NaN"):
        troll_token_terms(logits, ids, nan, sampled, sampled_lp)
    with pytest.raises(TrollInputError, match="sum to"):
        troll_token_terms(logits, ids, lps + 1.0, sampled, sampled_lp)
    with pytest.raises(TrollInputError, match=r"\[N=4\]"):
        troll_token_terms(logits, ids, lps, sampled[:3], sampled_lp)


def test_a_permutation_of_the_vocabulary_changes_no_result_on_bf16_valued_logits():
    """Issue 41: bf16 logits over a real vocabulary tie often; with S_t taken in whole tie groups (Top(pi) and
    Top(mu), both rules) the result does not depend on which tied token a sort puts first. Permuting the vocabulary
    (columns and every id with them) moves log p(a_t), the regression term and the gradient by float32 rounding
    only (the issue measured 7.8e-3 on 28 of 192 rows before)."""
    rows, vocab, k = 192, 32768, 64
    gen = torch.Generator().manual_seed(41)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(torch.bfloat16).float()  # bf16 values
    logits[::4, 0] = 30.0  # peaked rows: ties among the tail decide Top(pi)'s boundary there
    mu_logits = (logits + 0.3 * torch.randn(rows, vocab, generator=gen)).to(torch.bfloat16).float()
    mu_logp = torch.log_softmax(mu_logits.double(), -1)
    lps, ids = mu_logp.topk(k, dim=-1)
    sampled = torch.multinomial(mu_logp.exp(), 1, generator=gen).squeeze(1)
    sampled_lp = mu_logp.gather(1, sampled[:, None]).squeeze(1)
    advantages = torch.randn(rows, generator=gen)
    perm = torch.randperm(vocab, generator=gen)  # new column j holds old column perm[j]
    new_id = torch.empty_like(perm)
    new_id[perm] = torch.arange(vocab)

    def run(x, ids, sampled):
        x = x.clone().requires_grad_()
        terms = troll_token_terms(x, ids, lps.float(), sampled, sampled_lp.float(), topk=k)
        (grad,) = torch.autograd.grad(troll_token_loss(terms, advantages).sum(), x)
        return terms, grad

    before, grad_before = run(logits, ids, sampled)
    after, grad_after = run(logits[:, perm], new_id[ids], new_id[sampled])
    assert torch.equal(before.diagnostics["support_size"], after.diagnostics["support_size"])
    assert torch.equal(before.diagnostics["projected"], after.diagnostics["projected"])
    assert bool(before.diagnostics["projected"].any()) and bool((~before.diagnostics["projected"]).any())
    for name in ("log_p_sampled", "regression_kl", "log_mu_sampled"):
        torch.testing.assert_close(getattr(after, name), getattr(before, name), rtol=0, atol=1e-5, msg=name)
    torch.testing.assert_close(grad_after[:, new_id], grad_before, rtol=0, atol=1e-5)
