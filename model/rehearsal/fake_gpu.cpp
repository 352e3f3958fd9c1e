// A GPU that exists only for the rehearsal: lets a CPU-only torch run fake `cuda` tensors
// through autograd, so one rank of a GPU plan rehearses on the device type it will train on.
//
// A CPU-only torch makes and computes fake `cuda` tensors (FakeTensorMode) but refuses two
// things backward needs: a device guard for `cuda` ("PyTorch is not linked with support
// for cuda devices") and CUDA hooks that say an accelerator exists ("Cannot access
// accelerator device when none is available"). Both are registered here. Nothing runs on
// a device: fake tensors have no storage, so every stream is the default one, every event
// is complete and every synchronisation returns at once.
//
// Load it (model/training/fake_gpu.py) before torch is imported: torch reads its CUDA hooks
// once, at their first use. Never load it where real tensors are computed.
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct FakeCudaGuard final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device d) const noexcept override {
    return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, d.index() < 0 ? 0 : d.index()));
  }
  Stream getNewStream(Device d, int) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const noexcept override { return getStream(s.device()); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}
};

struct FakeCudaHooks final : public at::CUDAHooksInterface {
  explicit FakeCudaHooks(at::CUDAHooksArgs) {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
};

C10_REGISTER_GUARD_IMPL(CUDA, FakeCudaGuard);

}  // namespace

namespace at {
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCudaHooks)
}  // namespace at
