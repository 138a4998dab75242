// A cuda build without cuDNN (fused_attention.h): no engine, so attention
// runs in the native kernels and attention="cudnn" is refused.
#include "cuda/fused_attention.h"

namespace nanoq {
namespace cuda {

std::unique_ptr<AttentionEngine> make_attention_engine() { return nullptr; }

std::string attention_engine_library() { return ""; }

bool attention_engine_preferred() { return false; }

}  // namespace cuda
}  // namespace nanoq
