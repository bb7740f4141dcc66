// troupe._checkpoint: the checkpoint library (checkpoint/) for troupe/checkpoint.py. Tensors
// travel as 1-D uint8 buffers (numpy arrays, or torch tensors viewed as bytes by the Python
// side), so this module needs neither LibTorch nor numpy's C API.
// Errors: a Status becomes troupe._checkpoint.Error(code, message); checkpoint.py turns it into
// CheckpointError and its subclasses.
// Thread-safety: called with the GIL held; it is released around copies and file I/O.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <fmt/format.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "troupe/checkpoint/checkpoint_dir.h"
#include "troupe/checkpoint/flash_segment.h"
#include "python_errors.h"

namespace py = pybind11;
using troupe::python::InvalidArgument;
using troupe::python::WrongType;

namespace troupe::checkpoint {
namespace {

// (name, dtype, shape)
using SpecTuple = std::tuple<std::string, std::string, std::vector<int64_t>>;

// Created at import; never freed (it lives as long as the interpreter).
PyObject* errorType = nullptr;

[[noreturn]] void raise(const Status& status) {
  PyErr_SetObject(errorType, py::make_tuple(statusCodeName(status.code()), status.message()).ptr());
  throw py::error_already_set();
}

template <typename T>
T unwrap(Result<T>&& result) {
  if (!result.isOk()) raise(result.status());
  return std::move(result).value();
}

// A contiguous buffer's address and size; `writable` for restore targets.
std::pair<void*, uint64_t> bufferOf(const py::buffer& obj, bool writable) {
  py::buffer_info info = obj.request(writable);
  uint64_t size = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
  // Contiguous in C order: each stride is the product of the later dimensions.
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expected) throw InvalidArgument("checkpoint buffers must be contiguous");
    expected *= info.shape[d];
  }
  return {info.ptr, size};
}

std::vector<TensorSpec> specsOf(const std::vector<SpecTuple>& tuples) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, dtype, shape] : tuples) specs.push_back(unwrap(makeTensorSpec(name, dtype, shape)));
  return specs;
}

std::vector<SpecTuple> tuplesOf(const std::vector<TensorSpec>& specs) {
  std::vector<SpecTuple> out;
  for (const auto& s : specs) out.emplace_back(s.name, s.dtype, s.shape);
  return out;
}

std::vector<ConstBuffer> constBuffers(const py::list& buffers) {
  std::vector<ConstBuffer> out;
  for (const auto& b : buffers) {
    auto [ptr, size] = bufferOf(py::reinterpret_borrow<py::buffer>(b), false);
    out.push_back({ptr, size});
  }
  return out;
}

py::dict headerDict(const ImageHeader& header) {
  py::dict d;
  d["step"] = header.stamp.step;
  d["rank"] = header.stamp.rank;
  d["world_size"] = header.stamp.worldSize;
  d["metadata"] = py::bytes(header.meta);
  d["tensors"] = tuplesOf(header.layout.tensors());
  return d;
}

py::dict slotDict(const SlotInfo& s) {
  py::dict d;
  d["index"] = s.index;
  d["state"] = slotStateName(s.state);
  d["step"] = s.step;
  d["complete"] = s.complete();
  d["image_bytes"] = s.imageBytes;
  d["writer_pid"] = s.writerPid;
  return d;
}

// A rank's snapshots in shared memory (FlashSegment), with the layout it was opened for.
class Segment {
 public:
  static Segment openForWrite(const std::string& dir, const std::string& name, const std::vector<SpecTuple>& tensors,
                              uint64_t metaCapacity, unsigned copyThreads) {
    Segment s;
    s.layout_ = unwrap(ImageLayout::plan(specsOf(tensors), metaCapacity));
    SegmentOptions o;
    o.dir = dir;
    o.name = name;
    o.copyThreads = copyThreads;
    std::optional<Result<FlashSegment>> opened;
    {
      py::gil_scoped_release nogil;  // allocating and pre-faulting a large segment takes a while
      opened.emplace(FlashSegment::openForWrite(o, s.layout_.imageBytes()));
    }
    s.segment_.emplace(unwrap(std::move(*opened)));
    return s;
  }
  // `writable` maps it for pin/discard_after (without the writer lock).
  static Segment openExisting(const std::string& dir, const std::string& name, unsigned copyThreads, bool writable) {
    Segment s;
    SegmentOptions o;
    o.dir = dir;
    o.name = name;
    o.copyThreads = copyThreads;
    s.segment_.emplace(unwrap(FlashSegment::openExisting(o, writable)));
    return s;
  }

  py::dict save(uint64_t step, uint32_t rank, uint32_t worldSize, const py::list& buffers, const py::bytes& meta) {
    auto tensors = constBuffers(buffers);
    std::string metaBytes = meta;
    std::optional<Result<SlotInfo>> slot;
    {
      py::gil_scoped_release nogil;
      slot.emplace(segment().save(layout_, {step, rank, worldSize}, tensors, metaBytes));
    }
    return slotDict(unwrap(std::move(*slot)));
  }

  py::list slots() const {
    py::list out;
    for (const auto& s : segment().slots()) out.append(slotDict(s));
    return out;
  }

  // The header of the newest complete snapshot (at most maxStep, or exactly `step`), or None.
  py::object peek(std::optional<uint64_t> step, std::optional<uint64_t> maxStep) const {
    auto slot = choose(step, maxStep);
    if (!slot) return py::none();
    const auto& s = segment();
    auto header = parseImageHeader(s.slotData(slot->index), std::min(slot->imageBytes, s.slotCapacity()));
    if (!header.isOk() || !s.unchanged(*slot)) return py::none();
    return headerDict(*header);
  }

  // Copies that snapshot into `targets` (one writable buffer per tensor), checking CRCs.
  py::dict restoreInto(std::optional<uint64_t> step, std::optional<uint64_t> maxStep, const py::list& targets) const {
    auto slot = choose(step, maxStep);
    if (!slot) {
      raise(Status(StatusCode::kNotFound, fmt::format("no complete snapshot{} in {}",
                                                       step ? fmt::format(" of step {}", *step) : "", segment().path())));
    }
    std::vector<MutableBuffer> out;
    for (const auto& b : targets) {
      auto [ptr, size] = bufferOf(py::reinterpret_borrow<py::buffer>(b), true);
      out.push_back({ptr, size});
    }
    std::optional<Result<ImageHeader>> header;
    {
      py::gil_scoped_release nogil;
      header.emplace(segment().restoreInto(*slot, out));
    }
    return headerDict(unwrap(std::move(*header)));
  }

  // Persists the newest complete snapshot into a checkpoint directory (what the actor does).
  py::dict persist(const std::string& path, uint32_t keep) const {
    DirectoryOptions o;
    o.path = path;
    o.keep = keep;
    std::optional<Result<PersistOutcome>> outcome;
    {
      py::gil_scoped_release nogil;
      CheckpointDirectory dir(o);
      Status opened = dir.open();
      auto slot = segment().newestComplete();
      if (!opened.isOk()) {
        outcome.emplace(opened);
      } else if (!slot) {
        outcome.emplace(Status(StatusCode::kNotFound, "no complete snapshot to persist"));
      } else {
        outcome.emplace(persistSnapshot(dir, segment(), *slot));
      }
    }
    auto o2 = unwrap(std::move(*outcome));
    py::dict d;
    d["bytes"] = o2.bytes;
    d["seconds"] = o2.seconds;
    d["step_complete"] = o2.stepComplete;
    return d;
  }

  // Saves leave the snapshot of `step` alone until another is pinned (FlashSegment::pin).
  void pin(uint64_t step) {
    Status s = segment().pin(step);
    if (!s.isOk()) raise(s);
  }
  // Empties the snapshots newer than `step`: the state went back to it.
  void discardAfter(uint64_t step) { segment().discardAfter(step); }

  uint64_t imageBytes() const { return layout_.imageBytes(); }
  std::string path() const { return segment().path(); }
  void remove() { Status s = segment().remove(); if (!s.isOk()) raise(s); }
  void close() { segment_.reset(); }

 private:
  const FlashSegment& segment() const {
    if (!segment_) throw InvalidArgument("the segment is closed");
    return *segment_;
  }
  FlashSegment& segment() {
    if (!segment_) throw InvalidArgument("the segment is closed");
    return *segment_;
  }
  std::optional<SlotInfo> choose(std::optional<uint64_t> step, std::optional<uint64_t> maxStep) const {
    return step ? segment().completeAt(*step) : segment().newestComplete(maxStep.value_or(UINT64_MAX));
  }

  ImageLayout layout_;
  std::optional<FlashSegment> segment_;
};

py::dict saveFiles(const std::string& path, uint64_t step, uint32_t rank, uint32_t worldSize,
                   const std::vector<SpecTuple>& tensors, const py::list& buffers, const py::bytes& meta, uint32_t keep) {
  std::string metaBytes = meta;
  auto layout = unwrap(ImageLayout::plan(specsOf(tensors), std::max<uint64_t>(metaBytes.size(), 4096)));
  auto data = constBuffers(buffers);
  DirectoryOptions o;
  o.path = path;
  o.keep = keep;
  std::optional<Result<PersistOutcome>> outcome;
  {
    py::gil_scoped_release nogil;
    CheckpointDirectory dir(o);
    Status opened = dir.open();
    outcome.emplace(opened.isOk() ? persistTensors(dir, layout, {step, rank, worldSize}, data, metaBytes)
                                  : Result<PersistOutcome>(opened));
  }
  auto done = unwrap(std::move(*outcome));
  py::dict d;
  d["bytes"] = done.bytes;
  d["step_complete"] = done.stepComplete;
  d["path"] = CheckpointDirectory(o).rankPath(step, rank);
  return d;
}

// Loads a rank of the newest usable step: (header dict, [uint8 arrays], [skipped reasons]).
py::tuple loadFiles(const std::string& path, uint32_t rank, std::optional<uint64_t> maxStep, const py::object& allocate) {
  DirectoryOptions o;
  o.path = path;
  std::vector<py::object> arrays;
  std::optional<Result<LoadedRank>> loaded;
  {
    py::gil_scoped_release nogil;
    CheckpointDirectory dir(o);
    auto alloc = [&](size_t index, const TensorSpec& spec) -> Result<void*> {
      py::gil_scoped_acquire gil;
      if (index == 0) arrays.clear();  // a new candidate step
      py::object array = allocate(spec.bytes);
      auto [ptr, size] = bufferOf(py::reinterpret_borrow<py::buffer>(array), true);
      if (size != spec.bytes) return Status(StatusCode::kInternal, "allocator returned a buffer of the wrong size");
      arrays.push_back(std::move(array));
      return ptr;
    };
    loaded.emplace(loadRank(dir, rank, alloc, maxStep.value_or(UINT64_MAX)));
  }
  auto result = unwrap(std::move(*loaded));
  py::list out;
  for (auto& a : arrays) out.append(a);
  // A step whose tensors are all empty never called the allocator.
  return py::make_tuple(headerDict(result.header), out, result.skipped);
}

std::vector<uint64_t> completeSteps(const std::string& path) {
  DirectoryOptions o;
  o.path = path;
  return unwrap(CheckpointDirectory(o).completeSteps());
}

}  // namespace
}  // namespace troupe::checkpoint

PYBIND11_MODULE(_checkpoint, m) {
  troupe::python::registerErrors();
  using namespace troupe::checkpoint;
  m.doc() = "Troupe's checkpoint library (shared-memory snapshots, the persisted format)";
  errorType = PyErr_NewException("troupe._checkpoint.Error", nullptr, nullptr);
  m.attr("Error") = py::reinterpret_borrow<py::object>(errorType);
  m.def("default_shm_dir", &defaultShmDir);
  m.def("segment_name", [](const std::string& group, const std::string& node, uint32_t rank, bool replica) {
    return unwrap(segmentName(group, node, replica ? SegmentKind::kReplica : SegmentKind::kPrimary, rank));
  }, py::arg("group"), py::arg("node"), py::arg("rank"), py::arg("replica") = false);
  m.def("dtype_size", [](const std::string& dtype) { return dtypeSize(dtype); });
  py::class_<Segment>(m, "Segment")
      .def_static("open_for_write", &Segment::openForWrite, py::arg("dir"), py::arg("name"), py::arg("tensors"),
                  py::arg("meta_capacity"), py::arg("copy_threads") = 2)
      .def_static("open_existing", &Segment::openExisting, py::arg("dir"), py::arg("name"), py::arg("copy_threads") = 2,
                  py::arg("writable") = false)
      .def("pin", &Segment::pin, py::arg("step"))
      .def("discard_after", &Segment::discardAfter, py::arg("step"))
      .def("save", &Segment::save, py::arg("step"), py::arg("rank"), py::arg("world_size"), py::arg("buffers"),
           py::arg("metadata"))
      .def("slots", &Segment::slots)
      .def("peek", &Segment::peek, py::arg("step") = py::none(), py::arg("max_step") = py::none())
      .def("restore_into", &Segment::restoreInto, py::arg("step"), py::arg("max_step"), py::arg("targets"))
      .def("persist", &Segment::persist, py::arg("path"), py::arg("keep") = 3)
      .def_property_readonly("image_bytes", &Segment::imageBytes)
      .def_property_readonly("path", &Segment::path)
      .def("remove", &Segment::remove)
      .def("close", &Segment::close);
  m.def("save_files", &saveFiles, py::arg("path"), py::arg("step"), py::arg("rank"), py::arg("world_size"),
        py::arg("tensors"), py::arg("buffers"), py::arg("metadata"), py::arg("keep"));
  m.def("load_files", &loadFiles, py::arg("path"), py::arg("rank"), py::arg("max_step"), py::arg("allocate"));
  m.def("complete_steps", &completeSteps, py::arg("path"));
}
