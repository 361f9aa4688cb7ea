"""FlashAttention-2 from scratch (to be written): FlashAttention2Pytorch and FlashAttention2Triton."""
