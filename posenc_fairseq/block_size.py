"""The one size of the blocks that long attention work is cut into."""

#: elements (B * H * rows * columns) of one block's temporary where work runs a block of queries at
#: a time (4 MiB in float32): a query block's logits, below which a call is not split
#: (kernels/blocks.py); a block's probabilities in the fused CPU backward (kernels/biased_cpu.py); a
#: chunk's products in `encodings.positions.shifted_product`. Each of these modules reads it as its
#: own global, so a test can shrink one loop's blocks alone.
BLOCK_ELEMENTS = 2 ** 20


def rows_per_block(elements: int, row_elements: int, minimum: int) -> int:
    """How many rows of `row_elements` each one block of `elements` holds, at least `minimum`. (Each
    caller passes its own module's BLOCK_ELEMENTS, which a test may have shrunk.)"""
    return max(minimum, elements // max(1, row_elements))
