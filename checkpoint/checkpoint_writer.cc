// checkpoint_writer: a stand-in trainer for the multi-process checkpoint tests. Snapshots a test
// state (checkpoint/test_state.h: bytes that depend on step and rank) into a rank's segment, one
// save per step, printing "saved <step>" after each; $TROUPE_CHECKPOINT_FAULT can stop it half-way
// through a save so the test can kill -9 it there. Exit code 1 (with the error on stderr) when a
// save fails, e.g. for lack of shared memory.
#include <cstdio>
#include <sstream>

#include <CLI/CLI.hpp>

#include "troupe/checkpoint/test_state.h"
#include "troupe/checkpoint/flash_segment.h"

int main(int argc, char** argv) {
  using namespace troupe::checkpoint;
  CLI::App app{"Writes test snapshots into a checkpoint segment"};
  std::string shmDir, segment, steps;
  uint32_t rank = 0, world = 1;
  uint64_t bytes = 1 << 20;
  app.add_option("--shm-dir", shmDir)->required();
  app.add_option("--segment", segment)->required();
  app.add_option("--rank", rank);
  app.add_option("--world-size", world);
  app.add_option("--steps", steps, "comma-separated steps to save in order")->required();
  app.add_option("--bytes", bytes, "size of the large tensor");
  CLI11_PARSE(app, argc, argv);

  testing::TestState state(bytes, rank);
  auto layout = state.layout();
  SegmentOptions options;
  options.dir = shmDir;
  options.name = segment;
  auto writer = FlashSegment::openForWrite(options, layout.imageBytes());
  if (!writer.isOk()) {
    fprintf(stderr, "checkpoint_writer: %s\n", writer.status().toString().c_str());
    return 1;
  }
  std::stringstream list(steps);
  for (std::string item; std::getline(list, item, ',');) {
    uint64_t step = std::stoull(item);
    state.fill(step);
    auto slot = writer->save(layout, {step, rank, world}, state.buffers(), "step " + item);
    if (!slot.isOk()) {
      fprintf(stderr, "checkpoint_writer: %s\n", slot.status().toString().c_str());
      return 1;
    }
    printf("saved %llu\n", static_cast<unsigned long long>(step));
    fflush(stdout);
  }
  return 0;
}
