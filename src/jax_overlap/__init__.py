"""jax-overlap: exact control over when communication and computation run."""

from jax_overlap._src.collectives.api import all_gather_start as all_gather_start
from jax_overlap._src.collectives.api import all_to_all_start as all_to_all_start
from jax_overlap._src.collectives.api import ppermute_start as ppermute_start
from jax_overlap._src.collectives.api import psum_scatter_start as psum_scatter_start
from jax_overlap._src.collectives.api import psum_start as psum_start
from jax_overlap._src.collectives.broadcast import pvary_start as pvary_start
from jax_overlap._src.collectives.api import ragged_all_to_all_start as ragged_all_to_all_start
from jax_overlap._src.collectives.future import Future as Future
from jax_overlap._src.collectives.remat_policy import all_to_alls_saveable as all_to_alls_saveable
from jax_overlap._src.collectives.not_async import CollectiveNotAsyncWarning as CollectiveNotAsyncWarning
from jax_overlap._src.collectives.future import FutureNotFinishedWarning as FutureNotFinishedWarning
from jax_overlap._src.collectives.misuse import FutureNotFinishedError as FutureNotFinishedError
from jax_overlap._src.xla.compiled_order import OrderNotKeptWarning as OrderNotKeptWarning
from jax_overlap._src.ordering.decorator import program_order as program_order
from jax_overlap._src.patterns.fsdp.scan import fsdp_scan as fsdp_scan
from jax_overlap._src.patterns.fsdp.plan import fsdp_plan as fsdp_plan
# Seeing the overlap: the report, its cost model and hardware profiles.
from jax_overlap._src.inspection.api import overlap_report as overlap_report
# Deprecated alias of overlap_report, kept one release; not in __all__, so a
# star import does not shadow the standard library's `inspect`.
from jax_overlap._src.inspection.api import inspect as inspect
from jax_overlap._src.inspection.measured.measure import measure as measure
from jax_overlap._src.inspection.measured.measured_report import MeasuredReport as MeasuredReport
from jax_overlap._src.inspection.measured.xplane import ProfileReadError as ProfileReadError
from jax_overlap._src.inspection.errors import HardwareProfileError as HardwareProfileError
from jax_overlap._src.inspection.errors import HloParseError as HloParseError
from jax_overlap._src.inspection.model.hardware import HardwareProfile as HardwareProfile
from jax_overlap._src.inspection.report.overlap_report import OverlapReport as OverlapReport

# Every exception and warning class, in one public module (as jax.errors).
from jax_overlap import errors as errors

# Overlap patterns, built on the public names above.
from jax_overlap._src.patterns.collective_matmul import all_gather_matmul as all_gather_matmul
from jax_overlap._src.patterns.collective_matmul import matmul_reduce_scatter as matmul_reduce_scatter
from jax_overlap._src.patterns.matmul_psum import matmul_psum as matmul_psum
from jax_overlap._src.patterns.moe.expert_parallel import expert_parallel as expert_parallel
from jax_overlap._src.patterns.moe.stream import ExpertStream as ExpertStream
from jax_overlap._src.patterns.moe.stream import expert_stream as expert_stream
from jax_overlap._src.patterns.attention.layout import from_layout as from_layout
from jax_overlap._src.patterns.attention.layout import to_layout as to_layout
from jax_overlap._src.patterns.attention.ring import ring_attention as ring_attention
from jax_overlap._src.patterns.attention.ulysses import ulysses_attention as ulysses_attention
from jax_overlap._src.patterns.pipeline.layout import pipeline_stage_layout as pipeline_stage_layout
from jax_overlap._src.patterns.pipeline.loss import pipeline_loss as pipeline_loss
from jax_overlap._src.patterns.pipeline.plan import PipelinePlan as PipelinePlan
from jax_overlap._src.patterns.pipeline.placing import pipeline_schedule as pipeline_schedule

__all__ = [
    "Future",
    "FutureNotFinishedError",
    "FutureNotFinishedWarning",
    "HardwareProfile",
    "HardwareProfileError",
    "HloParseError",
    "OrderNotKeptWarning",
    "OverlapReport",
    "MeasuredReport",
    "ProfileReadError",
    "all_gather_start",
    "all_to_all_start",
    "all_to_alls_saveable",
    "fsdp_scan",
    "fsdp_plan",
    "measure",
    "overlap_report",
    "ppermute_start",
    "program_order",
    "psum_scatter_start",
    "psum_start",
    "pvary_start",
    "ragged_all_to_all_start",
    "errors",
    # Overlap patterns.
    "all_gather_matmul",
    "expert_parallel",
    "expert_stream",
    "ExpertStream",
    "matmul_psum",
    "matmul_reduce_scatter",
    "PipelinePlan",
    "pipeline_loss",
    "pipeline_schedule",
    "pipeline_stage_layout",
    "from_layout",
    "ring_attention",
    "to_layout",
    "ulysses_attention",
]
__version__ = "0.1.0"
