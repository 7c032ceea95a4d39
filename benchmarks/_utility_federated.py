"""The federation curve's federated points: real sites, real SecAgg+, in one process."""

from __future__ import annotations

import statistics
from pathlib import Path

from client.service.inprocess import in_process_sites, site_settings_for_partition
from dpmtv_common.artifact import load_artifact
from dpmtv_common.crypto import SigningKey, TrustedKeys
from dpmtv_common.privacy.noise import secure_noise
from server.coordinator import run_coordinated_release
from server.settings import CoordinatorSettings, RunConfig
from server.simulation import InProcessGrid, make_server_context


def _keys(root: Path) -> Path:
    key_path = root / "coordinator.key"
    if not key_path.exists():
        key = SigningKey.generate()
        key.save(key_path)
        key.verify_key.save(root / "coordinator.pub")
    return key_path


def federated_accuracy(bench, sites: int, root: Path, args):
    """Mean +- std accuracy of `draws` federated releases at eps=1 with `sites` sites."""
    from utility import Row

    work = root / f"federation-{sites}"
    work.mkdir(parents=True, exist_ok=True)
    key = _keys(root)
    node_configs = [
        {
            "name": f"site-{i}",
            "model-path": str(args.model),
            "data-path": str(root / f"site-{i}"),
            "ledger-path": str(work / f"site-{i}.sqlite"),
            "artifacts-dir": str(work / f"site-{i}-artifacts"),
            "trusted-keys": str(root / "coordinator.pub"),
            "budget-epsilon": 1000.0,
            "min-sites": 2,
        }
        for i in range(sites)
    ]
    settings = CoordinatorSettings(
        signing_key=key,
        ledger_path=work / "consortium.sqlite",
        budget_epsilon=1000.0,
        artifacts_dir=work / "coordinator",
    )
    accuracies, snrs = [], []
    for draw in range(bench.draws):
        run_config = {
            "task": bench.task,
            "model-fingerprint": bench.loaded.fingerprint,
            "epsilon": 1.0,
            "shots": bench.shots,
            "clip-norm": bench.clip_norm,
            "num-selected-heads": bench.heads,
            "expected-sites": sites,
            "min-sites": 2,
            "release-id": f"curve-{sites}-{draw}",
            "order": args.order,
        }
        site_settings = [site_settings_for_partition(i, c) for i, c in enumerate(node_configs)]
        with in_process_sites(site_settings) as in_process:
            grid = InProcessGrid(in_process.relays, num_nodes=sites, run_config=run_config)
            report = run_coordinated_release(
                grid,
                make_server_context(run_config),
                RunConfig.from_context(run_config),
                settings,
                secure_noise(),
            )
        artifact = load_artifact(
            report.artifact,
            trusted_keys=TrustedKeys.from_files([root / "coordinator.pub"]),
            expected_model_fingerprint=bench.loaded.fingerprint,
        )
        accuracies.append(bench.queries.accuracy(bench.loaded, (artifact.heads, artifact.values)))
        snrs.append(report.outcome.signal_to_noise)
    outcome = report.outcome
    figures = {
        "m": str(outcome.num_chunks),
        "K": str(bench.shots),
        "C": f"{bench.clip_norm:.3g}",
        "|S|": str(len(outcome.heads)),
        "L": str(outcome.heads.num_layers_in_scope),
        "sigma": f"{outcome.noise_std:.3g}",
        "SNR": f"{statistics.mean(snrs):.2f}",
        "seconds/release": f"{sum(report.stage_seconds.values()):.1f}",
    }
    return Row(
        f"{sites} sites (federated, SecAgg+)",
        statistics.mean(accuracies),
        statistics.pstdev(accuracies),
        figures,
    )
