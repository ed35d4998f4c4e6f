// fleetserve.BlockMatMul, an ONNX Runtime custom op on the CPU: Y [..., N] = A [..., K] @ W^T for
// a weight in blocks of 32 input columns, w = scale * code + minimum (4- or 8-bit codes), by the
// block kernel of block_matmul_cpu.cpp. Contract and inputs: kernels/ort_ops.py.
//
// Up to kKernelMaxRows rows (a decode token and its drafts) run the block kernel, a row's result
// the same whatever rows come with it; more rows (a prefill chunk) dequantize the weight once and
// multiply by torch's GEMM, which wins there (as edged's torch backend does). The attribute
// bf16_products picks the block kernel's precision (block_weight.h's Products).
//
// Errors (bad attributes when a session is created, inputs that do not match when it runs)
// return an ORT status naming the input: the caller's run fails, the process goes on.

#include "block_weight.h"
#include "cpu_kernels.h"
#include "ort_abi.h"

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // input columns per block
constexpr int64_t kKernelMaxRows = 32;  // edged.backends.quantize.BLOCK_KERNEL_MAX_ROWS
constexpr int64_t kMaxDimension = int64_t{1} << 31;  // K and N: their element counts stay in int64

// A failed ORT call or check, carried to the op's entry point as the status ORT gets back.
struct OrtFailure {
  OrtStatus* status;
};

class Api {
 public:
  explicit Api(const OrtApi* api) : api_(api) {}

  // Throws OrtFailure when an ORT call reports one.
  void check(OrtStatus* status) const {
    if (status != nullptr) throw OrtFailure{status};
  }
  [[noreturn]] void fail(const std::string& message) const { throw OrtFailure{status(ORT_INVALID_ARGUMENT, message)}; }
  // A status to return to ORT. NOTE: never null (null means success): without memory for one,
  // the process is failing anyway and ORT's own allocations abort it.
  OrtStatus* status(OrtErrorCode code, const std::string& message) const {
    return call<ort_api::CreateStatus>()(code, message.c_str());
  }
  // The status for whatever an entry point caught: the failure's own, else ORT_FAIL with `what`.
  OrtStatus* caught(const char* what) const {
    try {
      throw;
    } catch (const OrtFailure& failure) {
      return failure.status;
    } catch (const std::exception& e) {
      return status(ORT_FAIL, std::string(what) + ": " + e.what());
    } catch (...) {
      return status(ORT_FAIL, std::string(what) + ": unknown error");
    }
  }

  int64_t int_attribute(const OrtKernelInfo* info, const char* name) const {
    int64_t value = 0;
    check(call<ort_api::KernelInfoGetAttribute_int64>()(info, name, &value));
    return value;
  }

  struct Tensor {
    ONNXTensorElementDataType type;
    std::vector<int64_t> shape;
    int64_t elements;
    void* data;
  };

  Tensor tensor(const OrtValue* value) const {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    check(call<ort_api::GetTensorTypeAndShape>()(value, &info));
    Tensor t{};
    size_t rank = 0;
    OrtStatus* failed = call<ort_api::GetTensorElementType>()(info, &t.type);
    if (failed == nullptr) failed = call<ort_api::GetDimensionsCount>()(info, &rank);
    if (failed == nullptr) {
      t.shape.resize(rank);
      failed = call<ort_api::GetDimensions>()(info, t.shape.data(), rank);
    }
    call<ort_api::ReleaseTensorTypeAndShapeInfo>()(info);
    check(failed);
    t.elements = 1;
    for (int64_t d : t.shape) t.elements *= d;
    check(call<ort_api::GetTensorMutableData>()(const_cast<OrtValue*>(value), &t.data));
    return t;
  }

  Tensor input(const OrtKernelContext* context, size_t index) const {
    const OrtValue* value = nullptr;
    check(call<ort_api::KernelContext_GetInput>()(context, index, &value));
    if (value == nullptr) fail("BlockMatMul: input " + std::to_string(index) + " is missing");
    return tensor(value);
  }

  // Output 0 allocated with `shape`: its float32 data.
  float* output(OrtKernelContext* context, const std::vector<int64_t>& shape) const {
    OrtValue* value = nullptr;
    check(call<ort_api::KernelContext_GetOutput>()(context, 0, shape.data(), shape.size(), &value));
    void* data = nullptr;
    check(call<ort_api::GetTensorMutableData>()(value, &data));
    return static_cast<float*>(data);
  }

  template <typename E>
  typename E::Fn call() const {
    return ort_entry<E>(api_);
  }

 private:
  const OrtApi* api_;
};

struct BlockMatMulKernel {
  Api api;
  int64_t k, n, bits;
  Products products;

  // Y = A @ W^T over inputs (A, B, scales, minimums); throws OrtFailure on inputs that do not match.
  void compute(OrtKernelContext* context) const {
    const Api::Tensor a = api.input(context, 0), packed = api.input(context, 1);
    const Api::Tensor scales = api.input(context, 2), minimums = api.input(context, 3);
    if (a.type != ORT_TENSOR_FLOAT || a.shape.empty() || a.shape.back() != k) {
      api.fail("BlockMatMul: A must be float32 [..., K=" + std::to_string(k) + "]");
    }
    if (packed.type != ORT_TENSOR_UINT8 || packed.elements != n * (k * bits / 8)) {
      api.fail("BlockMatMul: B must be uint8 with N * K * bits / 8 = " + std::to_string(n * (k * bits / 8)) +
               " elements, got " + std::to_string(packed.elements));
    }
    for (const auto* t : {&scales, &minimums}) {
      if (t->type != ORT_TENSOR_FLOAT || t->elements != n * (k / kGroup)) {
        api.fail(std::string("BlockMatMul: ") + (t == &scales ? "scales" : "minimums") +
                 " must be float32 with N * K / 32 = " + std::to_string(n * (k / kGroup)) + " elements");
      }
    }
    std::vector<int64_t> out_shape(a.shape.begin(), a.shape.end() - 1);
    out_shape.push_back(n);
    float* const y = api.output(context, out_shape);
    const int64_t rows = a.elements / k;
    if (rows <= kKernelMaxRows) {
      const BlockWeightView w{static_cast<const uint8_t*>(packed.data), static_cast<const float*>(scales.data),
                              static_cast<const float*>(minimums.data), n, k, bits};
      block_matmul_into(static_cast<const float*>(a.data), rows, w, y, products);
      return;
    }
    const auto floats = torch::dtype(torch::kFloat);
    const torch::Tensor weight = block_dequantize(
        torch::from_blob(packed.data, {n, k * bits / 8}, torch::dtype(torch::kUInt8)),
        torch::from_blob(scales.data, {n, k / kGroup}, floats), torch::from_blob(minimums.data, {n, k / kGroup}, floats),
        bits);
    torch::Tensor out = torch::from_blob(y, {rows, n}, floats);
    torch::mm_out(out, torch::from_blob(a.data, {rows, k}, floats), weight.t());
  }
};

OrtStatus* create_kernel(const OrtCustomOp*, const OrtApi* ort, const OrtKernelInfo* info, void** kernel) {
  const Api api(ort);
  try {
    const int64_t k = api.int_attribute(info, "K"), n = api.int_attribute(info, "N");
    const int64_t bits = api.int_attribute(info, "bits");
    if (bits != 4 && bits != 8) api.fail("BlockMatMul: bits must be 4 or 8, got " + std::to_string(bits));
    if (k <= 0 || k % kGroup != 0 || k > kMaxDimension || n <= 0 || n > kMaxDimension) {
      api.fail("BlockMatMul: K must be a positive multiple of 32 and N positive, both at most 2^31, got K=" +
               std::to_string(k) + ", N=" + std::to_string(n));
    }
    const int64_t bf16 = api.int_attribute(info, "bf16_products");
    if (bf16 != 0 && bf16 != 1) api.fail("BlockMatMul: bf16_products must be 0 or 1, got " + std::to_string(bf16));
    if (bf16 == 1 && !bf16_products_built()) {
      api.fail("BlockMatMul: bf16_products=1 needs a CPU with AVX-512 BF16; export the graph again on this machine");
    }
    *kernel = new BlockMatMulKernel{api, k, n, bits, products_of(bf16 == 1)};
    return nullptr;
  } catch (...) {
    return api.caught("BlockMatMul");
  }
}

OrtStatus* compute(void* kernel, OrtKernelContext* context) {
  const auto* self = static_cast<const BlockMatMulKernel*>(kernel);
  try {
    self->compute(context);
    return nullptr;
  } catch (...) {  // a mismatched input, an allocation failure: the run fails, nothing aborts
    return self->api.caught("BlockMatMul");
  }
}

const OrtCustomOp kBlockMatMul = [] {
  OrtCustomOp op{};
  op.version = kOrtCustomOpVersion;
  op.GetName = [](const OrtCustomOp*) { return "BlockMatMul"; };
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputType = [](const OrtCustomOp*, size_t index) { return index == 1 ? ORT_TENSOR_UINT8 : ORT_TENSOR_FLOAT; };
  op.GetInputTypeCount = [](const OrtCustomOp*) -> size_t { return 4; };
  op.GetOutputType = [](const OrtCustomOp*, size_t) { return ORT_TENSOR_FLOAT; };
  op.GetOutputTypeCount = [](const OrtCustomOp*) -> size_t { return 1; };
  op.KernelDestroy = [](void* kernel) { delete static_cast<BlockMatMulKernel*>(kernel); };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return ORT_IO_REQUIRED; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return ORT_IO_REQUIRED; };
  op.GetInputMemoryType = [](const OrtCustomOp*, size_t) { return ORT_MEM_DEFAULT; };
  op.CreateKernelV2 = create_kernel;
  op.KernelComputeV2 = compute;
  return op;
}();

}  // namespace

// The domain "fleetserve" with BlockMatMul, added to the session options ORT is building.
// NOTE: the domain is never released: ORT reads it for as long as any session built from these
// options lives (one small object per session a backend creates).
extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                                const OrtApiBase* base) {
  const OrtApi* ort = base->GetApi(kOrtApiVersion);
  if (ort == nullptr) return nullptr;  // cannot happen for a runtime of version >= 16; nothing to report through
  const Api api(ort);
  OrtCustomOpDomain* domain = nullptr;
  try {
    api.check(api.call<ort_api::CreateCustomOpDomain>()("fleetserve", &domain));
    api.check(api.call<ort_api::CustomOpDomain_Add>()(domain, &kBlockMatMul));
    api.check(api.call<ort_api::AddCustomOpDomain>()(options, domain));
    return nullptr;
  } catch (...) {
    return api.caught("RegisterCustomOps");
  }
}
