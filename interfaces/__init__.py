"""Types shared by every Switchyard process, in Modular MAX's ``max.interfaces`` vocabulary.

This is the only package all processes import. It holds wire types (msgspec Structs), the msgpack
codec and the Protocols; no logic that needs torch.
"""

from interfaces.codec import msgpack_numpy_decoder, msgpack_numpy_encoder
from interfaces.outputs import (
    ErrorKind,
    GenerationStatus,
    LogProbabilities,
    RequestTimings,
    SchedulerResult,
    SchedulerStatus,
    TextGenerationOutput,
)
from interfaces.protocols import PipelineTokenizer, TokenGenerator
from interfaces.requests import (
    ImageMetadata,
    RequestID,
    StructuredOutput,
    TextContext,
    TextGenerationRequest,
    TextGenerationRequestFunction,
    TextGenerationRequestMessage,
    TextGenerationRequestTool,
)
from interfaces.sampling import SamplingParams
from interfaces.shared_memory import SharedMemoryArray
from interfaces.tool_parsing import (
    ParsedToolCall,
    ParsedToolCallDelta,
    ParsedToolResponse,
    ToolParser,
)

__all__ = [
    "ErrorKind",
    "GenerationStatus",
    "ImageMetadata",
    "LogProbabilities",
    "ParsedToolCall",
    "ParsedToolCallDelta",
    "ParsedToolResponse",
    "PipelineTokenizer",
    "RequestID",
    "RequestTimings",
    "SamplingParams",
    "SchedulerResult",
    "SchedulerStatus",
    "SharedMemoryArray",
    "StructuredOutput",
    "TextContext",
    "TextGenerationOutput",
    "TextGenerationRequest",
    "TextGenerationRequestFunction",
    "TextGenerationRequestMessage",
    "TextGenerationRequestTool",
    "TokenGenerator",
    "ToolParser",
    "msgpack_numpy_decoder",
    "msgpack_numpy_encoder",
]
