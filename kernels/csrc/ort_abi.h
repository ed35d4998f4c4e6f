// The parts of ONNX Runtime's C ABI that fleetserve's custom-op library uses, declared here
// because the onnxruntime wheel ships no headers.
//
// OrtApi is a table of function pointers whose order never changes between releases (new
// entries are only appended), so an entry is read by its index (OrtEntry). OrtCustomOp is the
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

}  // extern "C"

// The OrtApi entries used: each its index in the table (0-based, the fixed order) and its type.
template <size_t Index, typename F>
struct OrtEntry {
  static constexpr size_t index = Index;
  using Fn = F;
};
constexpr uint32_t kOrtApiVersion = 16;  // every entry below exists from this version on

namespace ort_api {
using CreateStatus = OrtEntry<0, OrtStatus* (*)(OrtErrorCode code, const char* message)>;
using CreateCustomOpDomain = OrtEntry<26, OrtStatus* (*)(const char* domain, OrtCustomOpDomain** out)>;
using CustomOpDomain_Add = OrtEntry<27, OrtStatus* (*)(OrtCustomOpDomain* domain, const OrtCustomOp* op)>;
using AddCustomOpDomain = OrtEntry<28, OrtStatus* (*)(OrtSessionOptions* options, OrtCustomOpDomain* domain)>;
using GetTensorMutableData = OrtEntry<51, OrtStatus* (*)(OrtValue* value, void** out)>;
using GetTensorElementType =
    OrtEntry<60, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, ONNXTensorElementDataType* out)>;
using GetDimensionsCount = OrtEntry<61, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, size_t* out)>;
using GetDimensions = OrtEntry<62, OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count)>;
using GetTensorTypeAndShape = OrtEntry<65, OrtStatus* (*)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out)>;
using KernelInfoGetAttribute_int64 =
    OrtEntry<86, OrtStatus* (*)(const OrtKernelInfo* info, const char* name, int64_t* out)>;
using KernelContext_GetInput =
    OrtEntry<90, OrtStatus* (*)(const OrtKernelContext* context, size_t index, const OrtValue** out)>;
using KernelContext_GetOutput = OrtEntry<91, OrtStatus* (*)(OrtKernelContext* context, size_t index,
                                                           const int64_t* dims, size_t count, OrtValue** out)>;
using ReleaseTensorTypeAndShapeInfo = OrtEntry<99, void (*)(OrtTensorTypeAndShapeInfo* info)>;
}  // namespace ort_api

// `api`'s entry E (one of ort_api's), as its function type.
template <typename E>
typename E::Fn ort_entry(const OrtApi* api) {
  return reinterpret_cast<typename E::Fn const*>(api)[E::index];
}
