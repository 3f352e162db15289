"""Where every byte of a KV cache lives: the versioned physical layout descriptor.

CONTRACT (implementation in progress; signatures are final):

Logical axes: L layer, B block, KV (0 key, 1 value; absent for MLA), N token in block,
H kv head, D element in head.

class Layout (attrs frozen):
    order:   tuple[str]        memory order of the axes inside one plane, outermost first
    planes:  tuple[str]        axes that select separate tensors ("KV", "L", or both)
    sizes:   dict[str,int]     logical size of every axis in order + planes
    dtype:   str               kvabi dtype name
    extents: dict[str,int]     physical (padded) size per order axis; default = sizes
    strides: dict[str,int]|None explicit BYTE strides per order axis; default C-contiguous
                               over extents
    plane_nbytes_: int|None    explicit plane size (>= computed), for alignment
    folds:   tuple[tuple[str]] groups of consecutive order axes merged into one view dim
    packing: int               splits the view dim holding H into (n/packing, packing)
    name:    str|None          preset name

    Layout.preset(name, spec, num_blocks, num_layers=1) -> Layout
    .num_planes, .plane_nbytes, .itemsize, .num_layers, .num_blocks
    .plane_shape  -> tuple[int]   shape of each plane tensor as the backend sees it
    .plane_strides -> tuple[int]  element strides of that view
    .view_axes    -> tuple[tuple[str]] logical axes of each view dim (folds, packing "p")
    .plane_index(layer=0, kv=0) -> int
    .byte_offset(layer=0, block=0, kv=0, token=0, head=0, dim=0) -> (plane, offset)
        (vectorized: numpy int arrays broadcast)
    .allocate_numpy(fill=0) -> list[np.ndarray]  planes shaped plane_shape
    .layer_view(planes, layer) -> tuple of per-layer tensors (L indexed away / planes
        picked): one tensor when KV is inside the plane (or MLA), (K, V) when KV is a
        plane axis.  Works for numpy, torch, jax (jax copies).
    .kv_view(planes, layer, kv) -> strided view [B, N, H, D] (logical sizes, no copy)
        for numpy and torch; writes through.
    .is_block_contiguous -> bool   one byte range per block (all layers) in each plane
    .block_regions(block_ids, layers=None) -> list[(plane, offset, nbytes)]
        fewest contiguous byte regions holding those blocks, adjacent merged.
    .to_json() -> str ; Layout.from_json(text) -> Layout  (untrusted input)
"""
