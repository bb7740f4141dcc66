#include "troupe/runtime/io_thread.h"

#include "troupe/runtime/logging.h"

namespace troupe {

IoThread::IoThread() : work_(asio::make_work_guard(context_)), thread_([this]() {
  try {
    context_.run();
  } catch (const std::exception& e) {
    TROUPE_CHECK(false, "uncaught exception on the I/O thread: {}", e.what());
  }
}) {}

IoThread::~IoThread() {
  work_.reset();
  context_.stop();
  thread_.join();
}

}  // namespace troupe
