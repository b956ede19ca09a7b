"""Routing with a margin, for the mixture-of-experts bf16 references (moe_reference.py --dtype bf16).

A router picks each token's top-k experts by score. On a tiny random model some token's k-th and
(k+1)-th scores always lie within bf16's rounding of each other (a few hundred (token, layer)
pairs over 3 steps, their gaps spread like uniform spacings: the smallest is a few thousandths of
the scores' spread, less than the ~2% of it torch's bf16 moves a router logit by). Such a token
goes to one expert in torch's fp32 run and to another in a bf16 run, keel's or torch's own, and the
few rows an expert gets then move its weights by far more than bf16's arithmetic does: the bf16
reference measures a coin toss, not bf16 (docs/models.md, the seeds that flipped). Drawing the
router at a larger scale does not help: a softmax router's top-k is the same for W and c W, and
bf16's relative rounding scales with it.

So the bf16 runs start from a model whose every token's routing has a margin by construction
(margin_model), and the test asserts that margin from torch's own router scores at every token,
layer and step (check_margins), so that a future flip fails as "no margin", not as a loss mismatch:

  - each sparse layer's router reads its own E orthonormal directions of the residual stream:
    router row e = ROUTER_SCALE u_e / w, w the layer's post_attention_layernorm weight, so that its
    logit is ROUTER_SCALE (u_e . h) / rms(h) whatever the norm's weights;
  - every token's embedding row holds, along those directions, the router logits it is to be
    routed by, drawn per token and layer until their flip distance is at least DESIGN_DISTANCE
    (softmax routers: logits N(0, 1); GLM-4.5: sigmoid scores U(0.05, 0.95), whose choice scores
    add the layer's e_score_correction_bias); the rest of the row is random and orthogonal to them,
    the row's RMS EMBED_RMS for every token, so RMSNorm divides every row alike;
  - the attention and the MLPs add a few percent of that RMS to the residual stream (their
    matrices N(0, 0.02)), so torch's scores land near the drawn ones, and the checks measure them.

A token's flip distance (flip_distance) is a lower bound on the change of its scores (each by at
most that much) that could change the experts it goes to: half the gap between its k-th and
(k+1)-th choice scores among the experts it may choose, and for GLM-4.5's group-limited top-k a
quarter of the gap between the topk_group-th and next group score (a group's score sums two choice
scores, so two groups' scores move apart by up to four times a score's change).
"""
import math

import torch

EMBED_RMS = 1.0  # the embedding rows' RMS (moe_reference's random rows: 0.5); the blocks add ~3% of it
ROUTER_SCALE = 2.0  # the router rows' norm before the norm weight's division (entries ~0.25)
# What margin_model draws each token's scores to: softmax routers in logits, GLM-4.5 in choice
# scores (sigmoid + bias), both ~12x the largest change torch's bf16 makes to a score (measured by
# check_margins: 0.019 of a logit, 0.005 of a choice score).
DESIGN_DISTANCE = {"softmax": 0.25, "sigmoid": 0.06}
# check_margins: every token's flip distance, in torch's fp32 run, at least this many times the
# largest change torch's own bf16 runs make to any router score. keel's bf16 lands within 3x torch
# bf16's own distance from fp32 (moe_reference.BF16_GAP_FACTOR); at 4x a flip in keel's run would
# need keel to move a router score 4x as far as torch's bf16 does.
MARGIN_FACTOR = 4.0


def sigmoid_router(cfg):
    return cfg["model_type"] == "glm4_moe"


def router_layers(tensors):
    """{layer index: router weight name} of the sparse layers (in-memory names)."""
    out = {}
    for n in tensors:
        if n.endswith(".mlp.gate.weight") and n.startswith("model.layers."):
            out[int(n.split(".")[2])] = n
    return dict(sorted(out.items()))


def flip_distance(cfg, scores):
    """Per row of scores [tokens, experts] (a softmax router's logits, or GLM-4.5's choice scores
    sigmoid(logit) + e_score_correction_bias): the module docstring's lower bound on the change of
    the scores that could change the row's chosen experts (float64)."""
    s = scores.double()
    k, (T, E) = cfg["num_experts_per_tok"], s.shape
    if not sigmoid_router(cfg):
        top = s.topk(k + 1, dim=-1).values
        return (top[:, k - 1] - top[:, k]) / 2
    G, kept_groups = cfg["n_group"], cfg["topk_group"]
    group = s.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)  # Glm4MoeTopkRouter's group scores
    distance = torch.full((T,), math.inf, dtype=torch.float64)
    if kept_groups < G:
        top = group.topk(kept_groups + 1, dim=-1).values
        distance = (top[:, kept_groups - 1] - top[:, kept_groups]) / 4
    kept = torch.zeros(T, G, dtype=torch.bool)
    kept[torch.arange(T).unsqueeze(1), group.topk(kept_groups, dim=-1).indices] = True
    allowed = s.masked_fill(~kept.repeat_interleave(E // G, dim=1), -math.inf)
    if kept_groups * (E // G) > k:
        top = allowed.topk(k + 1, dim=-1).values
        distance = torch.minimum(distance, (top[:, k - 1] - top[:, k]) / 2)
    return distance


def draw_logits(cfg, bias, gen):
    """One token's router logits for one layer, drawn until their flip distance is at least
    DESIGN_DISTANCE (bias: the layer's e_score_correction_bias, GLM-4.5's choice scores add it)."""
    E = bias.shape[0]
    want = DESIGN_DISTANCE["sigmoid" if sigmoid_router(cfg) else "softmax"]
    for _ in range(10000):
        if sigmoid_router(cfg):
            p = 0.05 + 0.9 * torch.rand(E, generator=gen, dtype=torch.float64)
            if flip_distance(cfg, (p + bias).unsqueeze(0))[0] >= want:
                return torch.log(p / (1 - p))
        else:
            logits = torch.randn(E, generator=gen, dtype=torch.float64)
            if flip_distance(cfg, logits.unsqueeze(0))[0] >= want:
                return logits
    raise RuntimeError("moe_routing: no router scores with a flip distance of %g in 10000 draws for %s (experts %d, "
                       "top-%d): lower DESIGN_DISTANCE" % (want, cfg["model_type"], E, cfg["num_experts_per_tok"]))


def margin_model(cfg, tensors, seed):
    """`tensors` (a model's weights in transformers' in-memory names) with the embedding and every
    sparse layer's router rebuilt as the module docstring says; the rest as it was."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(tensors)
    routers = router_layers(tensors)
    embed = tensors["model.embed_tokens.weight"]
    V, H = embed.shape
    E = tensors[next(iter(routers.values()))].shape[0]
    if E * len(routers) > H // 2:
        raise ValueError("moe_routing: %d sparse layers x %d experts need more directions than half the hidden size %d"
                         % (len(routers), E, H))
    basis = torch.linalg.qr(torch.randn(H, E * len(routers), generator=gen, dtype=torch.float64))[0]
    biases = [tensors.get(name[:-len("weight")] + "e_score_correction_bias", torch.zeros(E)).double()
              for name in routers.values()]
    rows = torch.empty(V, H, dtype=torch.float64)
    for v in range(V):
        logits = torch.cat([draw_logits(cfg, bias, gen) for bias in biases])
        code = basis @ (logits * EMBED_RMS / ROUTER_SCALE)
        rest = torch.randn(H, generator=gen, dtype=torch.float64)
        rest -= basis @ (basis.T @ rest)
        room = H * EMBED_RMS ** 2 - float(code @ code)
        if room <= 0:
            raise ValueError("moe_routing: token %d's router logits need a row norm above %g: raise ROUTER_SCALE"
                             % (v, math.sqrt(H) * EMBED_RMS))
        rows[v] = code + rest * math.sqrt(room) / rest.norm()
    out["model.embed_tokens.weight"] = rows.to(embed.dtype)
    for i, (layer, name) in enumerate(routers.items()):
        norm = tensors["model.layers.%d.post_attention_layernorm.weight" % layer].double()
        out[name] = (ROUTER_SCALE * basis[:, i * E:(i + 1) * E].T / norm).to(tensors[name].dtype)
    return out


def capture(model, cfg, where):
    """Forward hooks on the model's routers: each call appends (where[0], router name, choice
    scores [tokens, experts] in fp32, chosen experts sorted) to the returned list. where[0]: the
    caller's (step, micro-batch index), set before each forward. The scores are the router's own:
    its logits as it returns them (bf16 under autocast), GLM-4.5's sigmoid of them plus its bias,
    as Glm4MoeTopkRouter computes them."""
    calls = []

    def hook(name):
        def record(module, args, out):
            logits, chosen = out[0].detach(), out[2].detach()
            scores = logits.sigmoid() + module.e_score_correction_bias if sigmoid_router(cfg) else logits
            calls.append((where[0], name, scores.float(), chosen.sort(dim=-1).values))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n.endswith("mlp.gate")]
    if not handles:
        raise ValueError("moe_routing: no router (a module named *.mlp.gate) in %s" % type(model).__name__)
    return calls, handles


def check_margins(cfg, fp32, bf16_runs, masks, failures):
    """fp32, bf16_runs: capture()'s calls of torch's fp32 run and of each of its bf16 runs (the same
    micro-batches in the same order); masks: each micro-batch's attention mask (padding, whose
    routing reaches no loss, is left out). Every token's flip distance in the fp32 run must be at
    least MARGIN_FACTOR x the largest change any bf16 run makes to a router score, and no bf16 run
    may route a token elsewhere."""
    if not fp32 or any(len(run) != len(fp32) for run in bf16_runs):
        failures.append("router scores: %d calls in torch's fp32 run, %s in its bf16 runs (expected the same, > 0)"
                        % (len(fp32), [len(run) for run in bf16_runs]))
        return
    nearest = (math.inf, "")
    moved = (0.0, "")
    flipped = pairs = 0
    for i, (where, name, scores, chosen) in enumerate(fp32):
        valid = masks[where[1]].reshape(-1).bool()
        d = flip_distance(cfg, scores[valid])
        j = int(d.argmin())
        what = "step %d micro-batch %d %s token %d" % (where[0], where[1], name, int(valid.nonzero()[j]))
        nearest = min(nearest, (float(d[j]), what))
        pairs += int(valid.sum())
        for run in bf16_runs:
            other = run[i]
            if other[:2] != (where, name):
                failures.append("router scores: call %d is %s in a bf16 run, %s in fp32"
                                % (i, other[:2], (where, name)))
                return
            delta = (other[2][valid].double() - scores[valid].double()).abs().max()
            moved = max(moved, (float(delta), what.split(" token")[0]))
            flipped += int((other[3][valid] != chosen[valid]).any(-1).sum())
    ratio = nearest[0] / max(moved[0], 1e-30)
    print("routing margin: every token's experts stay put under a change of its %s below %.4g (the nearest: %s); "
          "torch's bf16 runs change a router score by at most %.4g (%s): %.1fx (at least %.0fx required); "
          "%d (token, sparse layer) pairs over %d steps, %d routed elsewhere in torch's bf16 runs"
          % ("choice scores" if sigmoid_router(cfg) else "router logits", nearest[0], nearest[1], moved[0], moved[1],
             ratio, MARGIN_FACTOR, pairs, max(c[0][0] for c in fp32), flipped))
    if flipped:
        failures.append("no margin: torch's own bf16 runs route %d (token, layer) pairs to other experts than its fp32 "
                        "run: the bf16 yardstick would measure routing flips (moe_routing.py)" % flipped)
    elif ratio < MARGIN_FACTOR:
        failures.append("no margin: a token's experts change if its router scores move by %.4g (%s), only %.1fx the "
                        "%.4g torch's bf16 moves them (at least %.0fx required; moe_routing.py)"
                        % (nearest[0], nearest[1], ratio, moved[0], MARGIN_FACTOR))
