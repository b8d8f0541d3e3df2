"""GNN layers with PyG's constructor arguments, parameter names and results, running on the
fused attention kernels (numpy on the CPU, cupy on CUDA). See docs/layers.md.

    conv = GATConv(64, 8, heads=8)
    conv.load_state_dict({k: v.detach().cpu().numpy() for k, v in pyg_conv.state_dict().items()})
    out = conv(x, graph, edge_attr=None)
    out, vjp = conv.vjp(x, graph)
    grads = vjp(dout)      # {"x": dx, "edge_attr": d_edge_attr, "params": {pyg_name: grad}}
"""
from .gat import GATConv
from .gatv2 import GATv2Conv
from .transformer import TransformerConv

__all__ = ["GATConv", "GATv2Conv", "TransformerConv"]
