"""The Triton Function's backward is the PyTorch Function's (as the handout allows a first version to be): its
numbers are right, but its backward runs torch matrix products on tiles of the attention, no Triton kernel."""

from examples.from_scratch import flash


class FlashAttention2Triton(flash.FlashAttention2Triton):
    # The bug.
    backward = flash.FlashAttention2Pytorch.backward


def get_flashattention_autograd_function_pytorch() -> type:
    return flash.FlashAttention2Pytorch


def get_flashattention_autograd_function_triton() -> type:
    return FlashAttention2Triton
