// IoThread: the process's I/O thread, owning one asio::io_context (Redis calls, timers,
// later collective sockets). It never touches KJ objects; results travel back to the KJ
// thread through cross-thread promise fulfillers.
// Thread-safety: call() and context() from any thread; the destructor from the owner.
#pragma once

#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <kj/async.h>

#include <thread>
#include <type_traits>

namespace troupe {

class IoThread {
 public:
  IoThread();
  ~IoThread();  // stops the context and joins; queued work is dropped
  IoThread(const IoThread&) = delete;
  IoThread& operator=(const IoThread&) = delete;

  asio::io_context& context() { return context_; }

  // Runs `fn` on the I/O thread; the promise resolves on the calling (KJ) thread. If the
  // thread stops first, the promise rejects instead of hanging.
  template <typename Func>
  kj::Promise<std::invoke_result_t<Func>> call(Func fn) {
    using T = std::invoke_result_t<Func>;
    auto paf = kj::newPromiseAndCrossThreadFulfiller<T>();
    asio::post(context_, [fn = kj::mv(fn), fulfiller = kj::mv(paf.fulfiller)]() mutable {
      fulfiller->fulfill(fn());
    });
    return kj::mv(paf.promise);
  }

 private:
  asio::io_context context_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  std::thread thread_;
};

}  // namespace troupe
