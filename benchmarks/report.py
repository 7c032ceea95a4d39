"""Write docs/benchmarks.md (and its plots) from the JSON of one run of each benchmark command.

    .venv/bin/python benchmarks/report.py

Reads docs/benchmarks/headline-{small,deep,pretrained}.json (benchmarks/headline.py),
docs/benchmarks/utility-{small,deep}.json (benchmarks/utility.py; one run per task
family), docs/benchmarks/untrained-candidates.json (benchmarks/untrained_candidates.py),
docs/benchmarks/audit-small.json (benchmarks/audit.py) and each model's training.json; every
figure in the page comes from those files, and the page names the command behind each.
"""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from dpmtv_common.thread_policy import apply_thread_policy

apply_thread_policy()  # before torch loads: its thread pool must not spin on shared cores

from _report_headline import (
    MIN_REFERENCE_GAIN,
    commands,
    headline_table,
    load_headlines,
    plot_headline,
    side_table,
)
from _utility_lib import headline_ratios

from client.models.embedded import ARCHITECTURES, EMBEDDED_MODEL_DIRS

DOCS = REPO / "docs"
DATA = DOCS / "benchmarks"
SIZES = ("small", "deep")
FAMILIES = ("trained", "untrained")


def _load(name: str) -> dict | None:
    path = DATA / name
    return json.loads(path.read_text()) if path.is_file() else None


def _pct(value: float) -> str:
    return "n/a" if value != value else f"{value:.0%}"  # NaN check without math


def _models_section(utility: dict[str, dict]) -> list[str]:
    lines = [
        "| model | text layers x heads | head dim | training command | training time | "
        "4-shot / 0-shot (validation scenes) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for size in SIZES:
        arch = ARCHITECTURES[size]
        training = json.loads((EMBEDDED_MODEL_DIRS[size] / "training.json").read_text())
        heads = arch["text_layers"] * arch["text_heads"]
        lines.append(
            f"| {size} | {arch['text_layers']} x {arch['text_heads']} = {heads} | "
            f"{arch['text_hidden'] // arch['text_heads']} "
            f"| `{training['command']}` | {training['seconds'] / 60:.0f} min (LM stage) | "
            f"{training['icl_4_shot']:.2f} / {training['zero_shot']:.2f} |"
        )
    return lines


def _headline(utility: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| family | model | task | zero-shot | MTV own selection | MTV same heads | "
        "DP-MTV eps=1 | std | m | **ratio (vs own selection)** | ratio (vs same heads) | "
        "own-head recall | test majority class |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    runs = [(f, size, r[f]) for f in FAMILIES for size, r in utility.items() if f in r]
    for family, size, result in runs:
        for h in result["headline"]:
            # Recomputed from the stored accuracies, so every run reads under one definition.
            ratios = headline_ratios(
                zero=h["zero"],
                dp=h["dp"],
                own_selection=h["oracle"],
                same_heads=h["mtv_same_heads"],
            )
            lines.append(
                f"| {family} | {size} | {h['task']} | {h['zero']:.3f} | {h['oracle']:.3f} | "
                f"{h['mtv_same_heads']:.3f} | {h['dp']:.3f} | {h['dp_std']:.3f} | {h['m']} | "
                f"**{_pct(ratios['ratio'])}** | {_pct(ratios['ratio_same_heads'])} | "
                f"{h['recall']:.2f} | {h['majority']:.3f} |"
            )
    return lines


def _untrained_note(utility: dict[str, dict[str, Any]]) -> list[str]:
    """What the untrained family's main task shows, read from its tables (not written by hand)."""
    parts, best, queries = [], 0.0, 0
    for size, runs in utility.items():
        if "untrained" not in runs:
            continue
        run = runs["untrained"]
        rows = {r["name"]: r["accuracy"] for r in run["table"]}
        icl = rows[f"{run['args']['shots']}-shot ICL"]
        mtv = rows["MTV, public heads (no clip, no noise)"]
        oracle = next(v for k, v in rows.items() if k.startswith("oracle"))
        best, queries = max(best, icl, mtv, oracle), int(run["args"]["test"])
        parts.append(
            f"{size}: zero-shot {rows['zero-shot']:.3f}, {run['args']['shots']}-shot ICL "
            f"{icl:.3f}, MTV (public heads) {mtv:.3f}, oracle {oracle:.3f}"
        )
    if not parts:
        return []
    # Two standard errors of a 0.5 accuracy on this many queries: above it, the rule is learned.
    beyond = 0.5 + 2 * (0.25 / queries) ** 0.5
    verdict = (
        f"so neither in-context learning nor a task vector goes beyond the shortcut 0.5 (by "
        f"more than two standard errors, {beyond:.3f}) on either model: the demonstrations "
        "carry which words answer (hence the gain over "
        "zero-shot, the ratio's denominator), not the merged rule. On this family the ratio "
        "measures how much of that answer-format gain DP-MTV keeps, and a model collapsed to "
        "one of the two words (modal share 1.00) scores the majority class, about as much: "
        "read accuracy with the modal share."
        if best <= beyond
        else f"so at least one model goes beyond the shortcut 0.5 (by more than two standard "
        f"errors, {beyond:.3f}): it learns part of the merged rule in context."
    )
    return [f"Untrained family, main task on test queries: {'; '.join(parts)}; {verdict}"]


def _rows(rows: list[dict], majority: float | None = None) -> list[str]:
    lines = [
        "| row | accuracy | std | MTV same heads | modal share | SNR | oracle recall | "
        "m | C | \\|S\\| | L | sigma |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def cell(row: dict, key: str, fmt: str) -> str:
        return format(row[key], fmt) if key in row else ""

    for row in rows:
        name = row["name"]
        if majority is not None and row.get("selection") == "all":
            name += f" (majority class {majority:.3f})"
        lines.append(
            f"| {name} | {row['accuracy']:.3f} | {cell(row, 'spread', '.3f')} | "
            f"{cell(row, 'same_heads_mtv', '.3f')} | {cell(row, 'modal_share', '.2f')} | "
            f"{cell(row, 'SNR', '.2f')} | {cell(row, 'recall', '.2f')} | {cell(row, 'm', 'd')} | "
            f"{cell(row, 'C', '.3g')} | {cell(row, '|S|', 'd')} | {cell(row, 'L', 'd')} | "
            f"{cell(row, 'sigma', '.3g')} |"
        )
    return lines


def _model_section(size: str, family: str, result: dict) -> list[str]:
    choice = result["choice"]
    args = result["args"]
    majority = next(h["majority"] for h in result["headline"] if h["task"] == args["task"])
    return [
        f"### {size} model ({result['shape'][0]} layers x {result['shape'][1]} heads), "
        f"task {args['task']} ({family} family)",
        "",
        f"`{result['command']}`: {result['seconds'] / 60:.1f} min. k = {args['heads']} heads, "
        f"K = {args['shots']}, {args['pooled']} pooled examples, {args['test']} test queries, "
        f"{args['draws']} noise draws a row. Public C0 = {result['clip_norm_public']:.3g}.",
        "",
        f"Choices on {args['validation']} validation queries (eps = 1, private selection, "
        f"{args['choice_draws']} draws each): **{choice['order']}, rescale "
        f"{'on' if choice['rescale'] else 'off'}, C = C0 x {choice['clip_factor']:g}**.",
        "",
        *_rows(result["validation"]),
        "",
        f"Test queries (majority class rate {majority:.3f}):",
        "",
        *_rows(result["table"], majority),
        "",
    ]


def _candidates_section(candidates: dict[str, Any]) -> list[str]:
    lines = [
        f"`{candidates['command']}` ({candidates['seconds'] / 60:.1f} min): "
        f"{candidates['validation']} validation queries, demonstrations and the MTV mean from "
        f"{candidates['public']} public (train-scene) examples; MTV in the k = 4 (small) / "
        "8 (deep) heads attribution picks on public data. *Shortcut*: the accuracy of answering "
        "the trained task whose words the candidate answers with (what recognising a known "
        "task reaches without learning the rule).",
        "",
        "| model | candidate | kind | zero-shot | 4-shot ICL | 8-shot ICL | MTV public heads | "
        "shortcut |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in candidates["rows"]:
        lines.append(
            f"| {r['model']} | {r['candidate']} | {r['family']} | {r['zero']:.3f} | "
            f"{r['icl_4']:.3f} | {r['icl_8']:.3f} | {r['mtv_public_heads']:.3f} | "
            f"{r['shortcut']:.3f} |"
        )
    # Two standard errors of an accuracy near 0.5 on this many queries (the widest case).
    margin = 2 * (0.25 / candidates["validation"]) ** 0.5
    rows = candidates["rows"]
    beyond = [
        f"{r['model']} {r['candidate']} ({shots}-shot ICL {r[f'icl_{shots}']:.3f})"
        for r in rows
        for shots in (4, 8)
        if r[f"icl_{shots}"] > r["shortcut"] + margin
    ] + [
        f"{r['model']} {r['candidate']} (MTV {r['mtv_public_heads']:.3f})"
        for r in rows
        if r["mtv_public_heads"] > r["shortcut"] + margin
    ]
    near = sum(abs(r["icl_4"] - r["shortcut"]) <= margin for r in rows)
    lines += [
        "",
        f"Above the shortcut by more than two standard errors ({margin:.3f}): "
        + ("; ".join(beyond) if beyond else "none")
        + f". 4-shot ICL lies within that margin of the shortcut in {near} of {len(rows)} "
        "rows: the demonstrations name the answer words, and the models answer the trained "
        "task that uses them.",
        "",
        *_gain_by_kind(rows),
    ]
    return lines


def _gain_by_kind(rows: list[dict[str, Any]]) -> list[str]:
    """Mean 4-shot ICL gain over zero-shot per kind of candidate and model (the denominator)."""
    gains: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        gains.setdefault(r["family"], {}).setdefault(r["model"], []).append(r["icl_4"] - r["zero"])
    mean = {kind: {m: sum(v) / len(v) for m, v in by.items()} for kind, by in gains.items()}
    best = max(mean, key=lambda kind: sum(mean[kind].values()))
    cells = "; ".join(
        f"{kind} " + ", ".join(f"{m} {g:+.3f}" for m, g in by.items()) for kind, by in mean.items()
    )
    return [
        f"Mean 4-shot ICL gain over zero-shot: {cells}. Largest over both models: **{best}**; "
        "the benchmark's untrained family is `-merged` (merged pairs)."
    ]


def _audit_section(audit: dict) -> list[str]:
    lines = [
        f"`{audit['command']}` ({audit['seconds'] / 60:.1f} min) ran:",
        "",
        *[f"    {command}" for command in audit["commands"]],
        "",
        f"Canary: replaces record {audit['canary']['replaces_index']} "
        f"({audit['canary']['id']}, answer {audit['canary']['answer']}); "
        f"{audit['changed_chunks']} chunk changed of m = {audit['num_chunks']}; "
        f"distance {audit['distance']:.4g} vs bound 2C*sqrt(L) = {audit['sensitivity']:.4g} "
        f"(strength {audit['distance'] / audit['sensitivity']:.2f}).",
        "",
        f"The release claims eps = {audit['reports'][0]['epsilon_claimed']:.3g} for its "
        "Gaussian part (the configuration's total eps = 1 also pays for private selection, "
        "which the audit does not cover).",
        "",
        "| noise | runs a side | mu claimed | mu of this canary | mu_hat | 95 % CI | "
        "eps claimed (Gaussian part) | eps lower bound (GDP) | eps lower bound (Clopper-Pearson) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]

    def fmt(value: float) -> str:
        return "inf" if value > 1e6 else f"{value:.3g}"

    for r in audit["reports"]:
        lines.append(
            f"| {r['label']} | {r['runs']} | {r['mu_claimed']:.3g} | {r['mu_canary']:.3g} | "
            f"{fmt(r['mu_hat'])} | [{fmt(r['mu_low'])}, {fmt(r['mu_high'])}] | "
            f"{r['epsilon_claimed']:.3g} | {fmt(r['epsilon_lower_gdp'])} | "
            f"{fmt(r['epsilon_lower_cp'])} |"
        )
    return lines


def _three_models(headlines: dict[str, dict[str, Any]]) -> list[str]:
    """The honest headline on every model measured, with its plot."""
    if not headlines:
        return []
    plot_headline(headlines, DATA / "headline.png")
    return [
        "## Headline: eps = 1, delta = 1e-5, task-agnostic public data, against what a site has "
        "without us",
        "",
        "Every public choice (the centre, the option, k, C') comes from labelled public sets "
        "of the *other* tasks of the family only: no example carries the private task's "
        "answers (`select-heads --public-task`). Every row releases the option the held-out "
        "simulation picks (public heads, or private selection among 2k public candidates, "
        "select-first or release-first with the Gaussian over the candidates, each cell "
        "tagged), its private picks scored on held-out queries that did not vote. "
        "Sites of 100 examples "
        "(20 chunks of K = 4 + 1); "
        "in central mode the 10-site row is also the single-holder release of those m = 200 "
        "chunks. **Ratio** = (DP-MTV - zero-shot) / (MTV with its own selection - zero-shot), "
        f"n/a where that MTV gains less than {MIN_REFERENCE_GAIN}; then DP-MTV's mean ± sd "
        "over the noise draws; `≤ best` marks a release that does not beat the best figure a "
        "consortium member has without one: public only (the centre patched into the same "
        "heads), the public same-task mean and 4-shot ICL from 20 public examples of the task "
        "(a labelled setting, stronger than task-agnostic), and a site's own 4-shot ICL. MTV's "
        "own selection is non-private and chooses heads on validation queries of the private "
        "task (an oracle). **Accuracy** here, of every row and baseline alike, is first-token "
        "accuracy: the share of test queries whose first greedy token is the answer's first "
        "token (`client/evaluation/first_token.py`, one forward pass a release, so that many "
        "noise draws can be scored). It bounds the product's own `evaluate` (the whole first "
        "answer span) from above: on the pretrained decoder a release names a colour and goes "
        "on with the other attributes ('red square4 right'), and so does the non-private mean, "
        "in the same heads and in MTV's own: on the README's pretrained demo (one release, "
        "m = 400) first token 0.52 and answer span 0.00, MTV's own selection 0.98 and 0.00, a "
        "site's own 4-shot ICL 1.00 and 1.00. With the answer's end learnt from the public "
        "sets of the other tasks (patched at the first decoding step: public data, no privacy "
        "cost, `--answer-end-from`) the answer span meets the first token: release 0.53, MTV's "
        "own selection 0.97, the same heads' non-private mean 0.60 against 0.60 "
        "([answer-span.md](benchmarks/answer-span.md)); over 20 noise draws of a 10-site "
        "release made the headline's way, colour 0.56 ± 0.18 both ways and position 0.31 ± "
        "0.31 against 0.32 ± 0.31 (the two scores differ in 1 draw of 40; "
        "[answer-span-draws.md](benchmarks/answer-span-draws.md)). The first-token figures "
        "below are what a site reads with the answer's end, on these one-token tasks. "
        "Commands:",
        "",
        *commands(headlines),
        "",
        *headline_table(headlines),
        "",
        "![accuracy against consortium size](benchmarks/headline.png)",
        "",
        "Each option and the centre, side by side in the same run (central; each option with "
        "its own public choices, the chosen one marked):",
        "",
        *side_table(headlines),
        "",
    ]


def main() -> int:
    utility = {size: r["families"] for size in SIZES if (r := _load(f"utility-{size}.json"))}
    candidates = _load("untrained-candidates.json")
    audit = _load("audit-small.json")
    headlines = load_headlines(DATA)
    lines = [
        "# Utility and privacy audit of DP-MTV",
        "",
        "Every figure below comes from one run of the commands named with it (JSON in "
        "docs/benchmarks/); this page is written by `.venv/bin/python benchmarks/report.py`. "
        f"Machine: 2 CPU cores shared with other jobs, Python {platform.python_version()}, "
        "one torch thread; run times are wall-clock on that shared machine.",
        "",
        "**Content-disjoint split** (`client.data.synthetic`, public rule): a scene is one of "
        "4^4 = 256 attribute combinations; (colour + shape + count-1 + position) mod 4 = 0 is "
        "test, 1 validation, 2-3 train. Models are trained on train scenes only; sites and "
        "public data show train scenes; choices (order, rescaling, C) are made on validation "
        "queries; every reported figure is on test queries, whose scenes nothing else showed.",
        "",
        "**Two task families** (`client.data.synthetic.task_family`). *Trained*: colour, shape, "
        "count, position, the four tasks the models were trained on (on other scenes). "
        "*Untrained*: `<attribute>-merged`, never shown in training: the attribute's four "
        "values merged pairwise into two of its own words (colour red/yellow -> red, "
        "green/blue -> blue; shape circle/square -> circle, triangle/cross -> triangle; count "
        "1/2 -> 1, 3/4 -> 3; position "
        "left/right -> left, top/bottom -> top). Its answers are balanced (majority class "
        "0.5), and so is the *shortcut*: a model that recognises the attribute from the "
        "demonstrations and answers it as trained is right on exactly half the queries; only "
        "accuracy above 0.5 would show the new rule learned. It was chosen among the "
        "candidates measured below on validation scenes.",
        "",
        "**Baselines with the same heads.** *MTV same heads*: the non-private MTV vector (the "
        "unclipped mean of the very same chunks) patched into the heads that each DP draw "
        "released (a diagnostic). *MTV own selection* (the oracle row): that non-private mean "
        "in the k heads that attribution picks on the validation queries with it, as MTV "
        "itself selects (full information, no privacy); the headline ratio's denominator. "
        "*Modal share*: share of test queries given the most frequent answer; 1.00 means the "
        "patch collapsed the model to one answer (compare with the majority-class rate). "
        "*Oracle recall*: share of the oracle heads that private selection found.",
        "",
        "The three-model headline combines the sites' production sums as the federation does "
        "(central: plain sum, one Gaussian draw; distributed: every site's discrete-Gaussian "
        "share on the SecAgg+ grid). Every DP row of the single-holder tables after it runs "
        "the single-holder path (`client.release.single_holder.LocalSums` and "
        "`protocol.run_release`, the code a federated release also runs after its secure sum) "
        "on 1000 pooled examples, "
        "m = 200 chunks of K = 4 + 1. The secure sum itself (masks, timings) is measured by "
        "`benchmarks/secure_sum.py` ([secure_sum.md](benchmarks/secure_sum.md)), not here.",
        "",
        "Elsewhere: the headline of each model per task and consortium size in "
        "[headline-small.md](benchmarks/headline-small.md), "
        "[headline-deep.md](benchmarks/headline-deep.md) and "
        "[headline-pretrained.md](benchmarks/headline-pretrained.md) (with C' swept at 10 sites "
        "in [headline-pretrained-sweep10.md](benchmarks/headline-pretrained-sweep10.md)); "
        "the pretrained-decoder model (270 heads) in "
        "[pretrained.md](benchmarks/pretrained.md) (MTV with its own selection, DP-MTV, and "
        "private selection's recall against the number of heads, with a plot) and "
        "[pretrained-curve.md](benchmarks/pretrained-curve.md) (DP-MTV against the pooled "
        "chunk count, i.e. the central-mode federation curve, at the median C) and "
        "[pretrained-curve-c4.md](benchmarks/pretrained-curve-c4.md) (at 4 x that C, where "
        "DP-MTV keeps the task); what helps private selection "
        "on many heads in [selection.md](benchmarks/selection.md); noise modes in "
        "[distributed.md](benchmarks/distributed.md); consortium size in "
        "[scale.md](benchmarks/scale.md); local serving in [serving.md](benchmarks/serving.md); "
        "tasks where a site alone is weak in "
        "[weak-site-candidates.md](benchmarks/weak-site-candidates.md) (and a site with one "
        "or two examples, in [weak-site-few-shots.md](benchmarks/weak-site-few-shots.md)) "
        "and, with sites holding "
        "a few classes each, [label-skew.md](benchmarks/label-skew.md) (non-private; on "
        "sixteen classes, one a site: "
        "[label-skew-colour-shape.md](benchmarks/label-skew-colour-shape.md)) and "
        "[label-skew-release.md](benchmarks/label-skew-release.md) (the DP release at up to "
        "48 sites, where release-first private selection among every head beats a site alone "
        "at 48, measured before release-first was restricted to its candidates; at 48 sites "
        "with public heads ranked by the centre's gain, public heads and release-first among "
        "every head beat a site alone and the option the public choice picks does not: "
        "[label-skew-release-48.md](benchmarks/label-skew-release-48.md); where "
        "the other head choices lost, with heads ranked by each public task's own mean: "
        "[label-skew-heads.md](benchmarks/label-skew-heads.md)); first-token accuracy "
        "against the answer a reader sees, with and without the public answer's end, on the "
        "pretrained demo's release, in [answer-span.md](benchmarks/answer-span.md).",
        "",
        "## Models",
        "",
        *_models_section(utility),
        "",
        "Both are trained by the committed script with the command shown (seeded, "
        "`torch.use_deterministic_algorithms`, one thread: bit-identical on one machine); the "
        "script writes `training.json` itself (command, seed, settings, library versions, "
        "held-out scores at every 100 steps) and `scores.json` (per task, on test scenes). "
        "`tests/integration/test_embedded_model.py` checks that record against the script's "
        "usage lines and retrains the small model's schedule up to step 200 to compare with "
        "its documented checkpoint.",
        "",
        *_three_models(headlines),
        "## Single holder in detail: eps = 1, delta = 1e-5, private selection (embedded models)",
        "",
        "(DP-MTV - zero-shot) / (MTV with its own head selection - zero-shot), in bold; the "
        "same-heads ratio beside it is a diagnostic (a bad private pick lowers its numerator and "
        "denominator together). The paper reports 75 % on VizWiz. "
        "Each family's rows come from one run of `benchmarks/utility.py` per model (the family's "
        "main task is the first row; the command is named with its table below). A ratio is "
        "n/a when its reference does not beat zero-shot (no denominator).",
        "",
        *_headline(utility),
        "",
        *_untrained_note(utility),
        "",
        "## Tables",
        "",
    ]
    for family in FAMILIES:
        for size, runs in utility.items():
            if family in runs:
                lines += _model_section(size, family, runs[family])
    if candidates:
        lines += ["## Choosing the untrained family", "", *_candidates_section(candidates), ""]
    if audit:
        lines += ["## Privacy audit (`dpmtv-site audit`)", "", *_audit_section(audit), ""]
        lines += [
            "What it shows and what it cannot: see `dpmtv-site audit --help`. The production "
            "row must have mu_hat consistent with the canary's mu (the noise is as calibrated) "
            "and below the claimed mu; the sigma-halved and noise-off rows are planted bugs "
            "that show the audit's power. The Clopper-Pearson bound is weak at these sample "
            "sizes; the GDP bound assumes Gaussian outputs. A lower bound below the claim does "
            "not prove the claim: it only fails to refute it for this canary.",
            "",
        ]
    lines += ["## Latency per query (batch 1, 3 new tokens, median of 20)", ""]
    lines += [
        "Measured while other jobs shared the 2 cores: compare modes within one row, not "
        "rows with each other.",
        "",
    ]
    lines += ["| model | zero-shot (s) | patched (s) | K-shot ICL (s) |", "|---|---:|---:|---:|"]
    for size, runs in utility.items():
        values = list(runs["trained"]["latency"].values())
        lines.append(f"| {size} | {values[0]:.4f} | {values[1]:.4f} | {values[2]:.4f} |")
    (DOCS / "benchmarks.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {DOCS / 'benchmarks.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
