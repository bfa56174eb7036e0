/* Constants shared by the GGUF kernels (gguf_mm.c, gguf_tile.c, decode_stack.c); the Python side's
 * counterparts are in model_executor/layers/quantization/gguf_blocks.py (TILED, MAX_PARTS). */
#ifndef PAGEDLLM_GGUF_COMMON_H
#define PAGEDLLM_GGUF_COMMON_H

#define GGUF_TILED 0x100  /* type flag: the weight is in gguf_tile_pack's layout */
#define GGUF_MAX_PARTS 4  /* weights one gguf_mm_parts call (or a decode-stack linear) stacks by output rows */

#endif
