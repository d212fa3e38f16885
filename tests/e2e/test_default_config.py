"""The default deployment (`configs/default.yaml`) as a Triton user first meets it: a burst of
12 concurrent single requests from tritonclient is answered, none refused, on a machine of
whatever speed (the server corrects its profiles from its workers' warm-up)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
import yaml

from tests.e2e.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]


def server_config(tmp_path: Path) -> dict:
    """configs/default.yaml as it is, but for `profiles`: the committed ones instead of
    `profiles: auto`'s first sweep (a minute here), which a machine of another speed makes
    the server correct before it serves, as a machine `auto` has not seen would."""
    cfg = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    assert cfg["policy"] == "dstack" and "profiles" not in cfg  # the product, profiles: auto
    return {**cfg, "profiles": str(ROOT / "profiles/cpu")}


def test_a_burst_of_twelve_single_requests_is_answered_and_none_refused(
        module_server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(module_server.url, concurrency=12)
    x = np.random.default_rng(0).random((1, 3, 224, 224), dtype=np.float32)
    pending = []
    for _ in range(12):
        inp = httpclient.InferInput("input", [1, 3, 224, 224], "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        pending.append(client.async_infer("resnet18", [inp]))
    # a refusal (429) raises InferenceServerException here, with the server's reason
    outs = [p.get_result().as_numpy("output") for p in pending]
    assert all(o.shape == (1, 1000) for o in outs)
    np.testing.assert_allclose(outs[0], outs[-1], rtol=1e-4, atol=1e-5)
    stats = client.get_inference_statistics("resnet18")["model_stats"][0]
    assert stats["inference_count"] == 12
    client.close()
