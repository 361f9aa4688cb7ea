"""What the DDP problems' rows name (cs336_systems.benchmarks.ddp measures, cs336_systems.reports.ddp reads): the
methods beside this project's wrappers, and each variant's label."""

TORCH_DDP_METHODS = ("torch_ddp", "torch_ddp_bucket_view")
# The implementation under test's wrappers, each named by the adapter function that builds it, with its hooks:
# (after backward, before each batch's forward), called with the wrapped model and its optimizer.
UNDER_TEST_METHODS = {
    "get_ddp_individual_parameters": ("ddp_individual_parameters_on_after_backward", None),
    "get_ddp_bucketed": ("ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"),
    "get_ddp": ("ddp_on_after_backward", None),
}


def variant_label(method: str, bucket_size_mb: float | None = None, implementation: str | None = None) -> str:
    """How rows name a variant; the implementation under test's are named after its adapters (their label)."""
    if implementation is not None:
        return f"{implementation}: {method}" + (f" {bucket_size_mb:g} MB" if bucket_size_mb is not None else "")
    return f"bucketed {bucket_size_mb:g} MB" if method == "bucketed" else method
