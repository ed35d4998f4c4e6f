// The parts of ONNX Runtime's C ABI that fleetserve's custom-op library uses, declared here
// because the onnxruntime wheel ships no headers.
//
// OrtApi is a table of function pointers whose order never changes between releases (new
// entries are only appended), so an entry is read by its index (OrtApiSlot). OrtCustomOp is the
// struct ORT reads an op from; its layout up to the version-16 members is spelled out, and
// `version` tells ORT which members exist: 16 gives the V2 create/compute members that return a
// status (an error reaches the caller as a failed run, nothing aborts). Facts checked against
// the 1.32 runtime: the API table 1..32 and each index below called by behaviour, the op struct
// of 208 bytes (members after the ones declared here are read only from version 17).
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

struct OrtApi;  // opaque: only read through ort_entry
struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;

struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);  // null where the runtime lacks that version
  const char* (*GetVersionString)();
};

enum OrtErrorCode : int { ORT_OK = 0, ORT_FAIL = 1, ORT_INVALID_ARGUMENT = 2 };
enum ONNXTensorElementDataType : int { ORT_TENSOR_FLOAT = 1, ORT_TENSOR_UINT8 = 2 };
enum OrtCustomOpInputOutputCharacteristic : int { ORT_IO_REQUIRED = 0 };
enum OrtMemType : int { ORT_MEM_DEFAULT = 0 };

struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);  // null: the CPU provider
  ONNXTensorElementDataType (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  ONNXTensorElementDataType (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  OrtCustomOpInputOutputCharacteristic (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtCustomOpInputOutputCharacteristic (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  OrtMemType (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);  // version 13
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);                 // version 14: variadic inputs only
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info,
                               void** kernel);                             // version 16
  OrtStatus* (*KernelComputeV2)(void* kernel, OrtKernelContext* context);
};
constexpr uint32_t kOrtCustomOpVersion = 16;  // the last member above

// The library's entry point ORT looks up after loading it; returns null on success.
using RegisterCustomOpsFn = OrtStatus* (*)(OrtSessionOptions* options, const OrtApiBase* api);

}  // extern "C"

// Indices of the OrtApi entries used (0-based, in the table's fixed order) and their types.
enum class OrtApiSlot : size_t {
  CreateStatus = 0,
  CreateCustomOpDomain = 26,
  CustomOpDomain_Add = 27,
  AddCustomOpDomain = 28,
  GetTensorMutableData = 51,
  GetTensorElementType = 60,
  GetDimensionsCount = 61,
  GetDimensions = 62,
  GetTensorTypeAndShape = 65,
  KernelInfoGetAttribute_int64 = 86,
  KernelContext_GetInput = 90,
  KernelContext_GetOutput = 91,
  ReleaseTensorTypeAndShapeInfo = 99,
};
constexpr uint32_t kOrtApiVersion = 16;  // every slot above exists from this version on

namespace ort_api {
using CreateStatus = OrtStatus* (*)(OrtErrorCode code, const char* message);
using CreateCustomOpDomain = OrtStatus* (*)(const char* domain, OrtCustomOpDomain** out);
using CustomOpDomain_Add = OrtStatus* (*)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
using AddCustomOpDomain = OrtStatus* (*)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
using GetTensorMutableData = OrtStatus* (*)(OrtValue* value, void** out);
using GetTensorElementType = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out);
using GetDimensionsCount = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
using GetDimensions = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count);
using GetTensorTypeAndShape = OrtStatus* (*)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
using KernelInfoGetAttribute_int64 = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, int64_t* out);
using KernelContext_GetInput = OrtStatus* (*)(const OrtKernelContext* context, size_t index, const OrtValue** out);
using KernelContext_GetOutput = OrtStatus* (*)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                               size_t count, OrtValue** out);
using ReleaseTensorTypeAndShapeInfo = void (*)(OrtTensorTypeAndShapeInfo* info);
}  // namespace ort_api

// The entry at `slot` of `api`, as the function type F.
template <typename F>
F ort_entry(const OrtApi* api, OrtApiSlot slot) {
  return reinterpret_cast<F const*>(api)[static_cast<size_t>(slot)];
}
