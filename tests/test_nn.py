"""tg.nn: layers, seeded initialisation, Sequential, trace."""
import math

import numpy as np
import pytest

import tiga_numba.nn as nn  # submodule import: the lazy package attribute is not involved


def test_linear_shapes_init_range_and_seed():
    lin = nn.Linear(7, 3, seed=4)
    assert lin.weight.shape == (3, 7) and lin.bias.shape == (3,)
    assert lin.weight.dtype == np.float32
    bound = 1 / math.sqrt(7)
    assert np.all(np.abs(lin.weight) <= bound) and np.all(np.abs(lin.bias) <= bound)
    again = nn.Linear(7, 3, seed=4)
    assert np.array_equal(lin.weight, again.weight) and np.array_equal(lin.bias, again.bias)
    other = nn.Linear(7, 3, seed=5)
    assert not np.array_equal(lin.weight, other.weight)
    assert nn.Linear(7, 3, seed=4, dtype=np.float64).weight.dtype == np.float64


def test_unseeded_layers_follow_manual_seed():
    nn.manual_seed(123)
    a = nn.Linear(4, 4).weight
    nn.manual_seed(123)
    b = nn.Linear(4, 4).weight
    assert np.array_equal(a, b)


def test_forward_of_layers_and_sequential():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 4))
    lin = nn.Linear(4, 2, seed=1, dtype=np.float64)
    np.testing.assert_allclose(lin(x), x @ lin.weight.T + lin.bias)
    np.testing.assert_allclose(nn.LeakyReLU(0.2)(x), np.where(x > 0, x, 0.2 * x))
    assert nn.LeakyReLU().negative_slope == 0.01
    np.testing.assert_allclose(nn.ReLU()(x), np.maximum(x, 0))
    np.testing.assert_allclose(nn.Tanh()(x), np.tanh(x))
    seq = nn.Sequential(lin, nn.Tanh(), nn.Linear(2, 1, seed=2, dtype=np.float64))
    np.testing.assert_allclose(seq(x), np.tanh(x @ lin.weight.T + lin.bias) @ seq[2].weight.T + seq[2].bias)
    assert seq[0] is lin and len(seq) == 3 and isinstance(seq[1:], nn.Sequential)


def test_named_parameters_and_trace():
    seq = nn.Sequential(nn.Linear(9, 16, seed=1), nn.LeakyReLU(0.2), nn.Linear(16, 1, seed=2))
    net = nn.trace(seq)
    assert net.__tiga_score_net__ is True and net.module is seq
    names = [n for n, _ in net.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert dict(net.named_parameters())["2.weight"] is seq[2].weight
    assert net.in_features == 9
    rng = np.random.default_rng(1)
    a, b, c = rng.standard_normal((6, 3)), rng.standard_normal((6, 4)), rng.standard_normal((6, 2))
    np.testing.assert_allclose(net(a, b, c), seq(np.concatenate([a, b, c], -1).astype(np.float32)), rtol=1e-5)


def test_trace_refuses_what_the_kernels_cannot_run():
    # a last width H > 1 is a per-head score (one softmax per head), not an error
    assert nn.trace(nn.Sequential(nn.Linear(3, 4), nn.ReLU())).out_features == 4
    assert nn.trace(nn.Linear(3, 1)).out_features == 1
    with pytest.raises(NotImplementedError, match="must start with a Linear"):
        nn.trace(nn.Sequential(nn.ReLU(), nn.Linear(3, 1)))
    with pytest.raises(ValueError, match="in_features=5 but the previous layer gives 4"):
        nn.trace(nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 1)))
    with pytest.raises(TypeError, match="trace expects"):
        nn.trace(lambda x: x)
    with pytest.raises(TypeError, match="must be a tiga_numba.nn module"):
        nn.Sequential(nn.Linear(2, 1), "relu")
    with pytest.raises(ValueError, match="in_features must be > 0"):
        nn.Linear(0, 1)
    with pytest.raises(TypeError, match="negative_slope must be a real number"):
        nn.LeakyReLU("steep")
    with pytest.raises(ValueError, match="negative_slope must be finite"):
        nn.LeakyReLU(float("nan"))
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        nn.Linear(2, 1, dtype=np.int32)


def test_to_cuda_needs_cupy_and_cpu_is_identity():
    seq = nn.Sequential(nn.Linear(2, 1, seed=0))
    w = seq[0].weight
    assert seq.to("cpu") is seq and seq[0].weight is w
    with pytest.raises(ValueError, match="device must be"):
        seq.to("tpu")
