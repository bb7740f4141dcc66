#include "troupe/runtime/tls.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <kj/compat/tls.h>
#include <kj/debug.h>

#include "forwarding_stream.h"

namespace troupe::tls {
namespace {

std::atomic<bool> gRequired{[]() {
  const char* v = std::getenv("TROUPE_TLS");
  return v != nullptr && std::string(v) == "1";
}()};

template <typename T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using BioPtr = std::unique_ptr<BIO, Deleter<BIO, BIO_free_all>>;
using KdfPtr = std::unique_ptr<EVP_PKEY_CTX, Deleter<EVP_PKEY_CTX, EVP_PKEY_CTX_free>>;
using SslCtxPtr = std::unique_ptr<SSL_CTX, Deleter<SSL_CTX, SSL_CTX_free>>;
using SslPtr = std::unique_ptr<SSL, Deleter<SSL, SSL_free>>;

std::string bioText(BIO* bio) {
  char* data = nullptr;
  long n = BIO_get_mem_data(bio, &data);
  return std::string(data, static_cast<size_t>(n));
}

void addExtension(X509* cert, int nid, const char* value) {
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, cert, cert, nullptr, nullptr, 0);
  X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
  KJ_REQUIRE(ext != nullptr, "cannot make a certificate extension");
  X509_add_ext(cert, ext, -1);
  X509_EXTENSION_free(ext);
}

std::string sslError() {
  unsigned long e = ERR_get_error();
  if (e == 0) return "no detail";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return buf;
}

// Everything a relay thread needs: the TLS connection and the two descriptors.
struct Relay {
  SslCtxPtr ctx;
  SslPtr ssl;
  int net = -1;
  int local = -1;
  std::atomic<bool> idle{false};  // every byte read from `local` has gone to TLS
  ~Relay() {
    if (net >= 0) ::close(net);
    if (local >= 0) ::close(local);
  }
};

// The running relays. A relay thread dies with its process, so at exit the process waits (at
// most 2 s) until each has sent on what its owner wrote: a rank that writes its last message
// (its goodbye) and returns from main must not lose it in the socketpair.
struct Relays {
  std::mutex mutex;
  std::condition_variable changed;
  std::set<Relay*> running;
};
Relays& relays() {
  static auto* all = new Relays;  // never destroyed: relay threads use it until the process ends
  return *all;
}

bool sentOn(Relay* r) {
  int unread = 0;
  return r->idle.load() && ::ioctl(r->local, FIONREAD, &unread) == 0 && unread == 0;
}

void drainRelaysAtExit() {
  auto& all = relays();
  std::unique_lock lock(all.mutex);
  all.changed.wait_for(lock, std::chrono::seconds(2),
                       [&]() { return std::all_of(all.running.begin(), all.running.end(), sentOn); });
}

void relayState(Relay* r, bool running) {
  auto& all = relays();
  {
    std::lock_guard lock(all.mutex);
    if (running) all.running.insert(r);
    else all.running.erase(r);
  }
  all.changed.notify_all();
}

// Moves bytes both ways until either side ends; one thread, non-blocking I/O, because one SSL
// object must not be used by two threads at once.
// A write to a peer that has gone raises SIGPIPE, which would kill the process; on this thread the
// write should just fail (EPIPE), so the signal stays blocked here and is never delivered.
void blockSigpipe() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

void pumpBytes(Relay* r);

void pump(std::unique_ptr<Relay> r) {
  pumpBytes(r.get());
  relayState(r.get(), false);
}

void pumpBytes(Relay* r) {
  blockSigpipe();
  // Large reads: every pass through the loop costs wake-ups, which cost more here than the crypto.
  std::vector<char> out(1 << 20), in(1 << 20);
  size_t outLen = 0, outOff = 0, inLen = 0, inOff = 0;
  for (;;) {
    bool progress = false, netRead = false, netWrite = false, localRead = false, localWrite = false;
    if (outLen == 0) {
      ssize_t n = ::read(r->local, out.data(), out.size());
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return;
      if (n > 0) outLen = static_cast<size_t>(n), outOff = 0, progress = true, r->idle = false;
      else localRead = true;
    }
    if (outLen > 0) {
      int n = SSL_write(r->ssl.get(), out.data() + outOff, static_cast<int>(outLen - outOff));
      if (n > 0) {
        outOff += static_cast<size_t>(n);
        if (outOff == outLen) outLen = 0;
        progress = true;
      } else {
        int e = SSL_get_error(r->ssl.get(), n);
        if (e == SSL_ERROR_WANT_READ) netRead = true;
        else if (e == SSL_ERROR_WANT_WRITE) netWrite = true;
        else return;
      }
    }
    if (inLen == 0) {
      // Decrypt every record already here before handing them on: one write, one wake-up.
      inOff = 0;
      while (inLen < in.size()) {
        int n = SSL_read(r->ssl.get(), in.data() + inLen, static_cast<int>(in.size() - inLen));
        if (n > 0) {
          inLen += static_cast<size_t>(n);
          progress = true;
          continue;
        }
        int e = SSL_get_error(r->ssl.get(), n);
        if (e == SSL_ERROR_WANT_READ) netRead = inLen == 0;
        else if (e == SSL_ERROR_WANT_WRITE) netWrite = inLen == 0;
        else if (inLen == 0) return;  // closed (close_notify or EOF) or broken
        break;
      }
    }
    if (inLen > 0) {
      ssize_t n = ::write(r->local, in.data() + inOff, inLen - inOff);
      if (n > 0) {
        inOff += static_cast<size_t>(n);
        if (inOff == inLen) inLen = 0;
        progress = true;
      } else if (n < 0 && errno != EAGAIN && errno != EINTR) {
        return;
      } else {
        localWrite = true;
      }
    }
    if (progress) continue;
    if (outLen == 0 && !r->idle.exchange(true)) relayState(r, true);  // wakes an exit waiting for it
    pollfd p[2] = {{r->local, static_cast<short>((localRead ? POLLIN : 0) | (localWrite ? POLLOUT : 0)), 0},
                   {r->net, static_cast<short>((netRead ? POLLIN : 0) | (netWrite ? POLLOUT : 0)), 0}};
    if (::poll(p, 2, -1) < 0 && errno != EINTR) return;
    if ((p[0].revents & (POLLERR | POLLNVAL)) || (p[1].revents & (POLLERR | POLLNVAL))) return;
  }
}

}  // namespace

Identity identity(const std::string& token) {
  unsigned char seed[32];
  size_t length = sizeof(seed);
  KdfPtr kdf(EVP_PKEY_CTX_new_id(EVP_PKEY_HKDF, nullptr));
  KJ_REQUIRE(kdf != nullptr && EVP_PKEY_derive_init(kdf.get()) == 1 && EVP_PKEY_CTX_set_hkdf_md(kdf.get(), EVP_sha256()) == 1 &&
                 EVP_PKEY_CTX_set1_hkdf_key(kdf.get(), reinterpret_cast<const unsigned char*>(token.data()),
                                            static_cast<int>(token.size())) == 1 &&
                 EVP_PKEY_CTX_set1_hkdf_salt(kdf.get(), reinterpret_cast<const unsigned char*>("troupe"), 6) == 1 &&
                 EVP_PKEY_CTX_add1_hkdf_info(kdf.get(), reinterpret_cast<const unsigned char*>("tls key v1"), 10) == 1 &&
                 EVP_PKEY_derive(kdf.get(), seed, &length) == 1,
             "deriving the cluster's TLS key failed", sslError());
  PkeyPtr key(EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, seed, sizeof(seed)));
  OPENSSL_cleanse(seed, sizeof(seed));
  KJ_REQUIRE(key != nullptr, "cannot make the cluster's Ed25519 key", sslError());
  X509Ptr cert(X509_new());
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  // Fixed dates and Ed25519's deterministic signature make the certificate the same everywhere.
  ASN1_TIME_set_string(X509_getm_notBefore(cert.get()), "20000101000000Z");
  ASN1_TIME_set_string(X509_getm_notAfter(cert.get()), "21000101000000Z");
  X509_set_pubkey(cert.get(), key.get());
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC, reinterpret_cast<const unsigned char*>(kServerName), -1, -1, 0);
  X509_set_issuer_name(cert.get(), name);
  addExtension(cert.get(), NID_subject_alt_name, fmt::format("DNS:{}", kServerName).c_str());
  addExtension(cert.get(), NID_basic_constraints, "critical,CA:TRUE");
  KJ_REQUIRE(X509_sign(cert.get(), key.get(), nullptr) > 0, "cannot sign the cluster certificate", sslError());
  BioPtr certBio(BIO_new(BIO_s_mem())), keyBio(BIO_new(BIO_s_mem()));
  PEM_write_bio_X509(certBio.get(), cert.get());
  PEM_write_bio_PrivateKey(keyBio.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr);
  return Identity{bioText(keyBio.get()), bioText(certBio.get())};
}

bool required() { return gRequired.load(std::memory_order_relaxed); }
void require() { gRequired.store(true, std::memory_order_relaxed); }

struct Streams::Impl {
  explicit Impl(const std::string& token)
      : id(identity(token)),
        keypair{kj::TlsPrivateKey(id.keyPem), kj::TlsCertificate(id.certPem)},
        trust(id.certPem),
        server(options(true)),
        client(options(false)) {}

  kj::TlsContext::Options options(bool asServer) {
    kj::TlsContext::Options o;
    o.useSystemTrustStore = false;
    o.trustedCertificates = kj::arrayPtr(&trust, 1);
    if (asServer) o.defaultKeypair = keypair;
    return o;
  }

  Identity id;
  kj::TlsKeypair keypair;
  kj::TlsCertificate trust;
  kj::TlsContext server;
  kj::TlsContext client;
};

Streams::Streams(const std::string& token) : impl_(std::make_unique<Impl>(token)) {}
Streams::~Streams() = default;

kj::Promise<kj::Own<kj::AsyncIoStream>> Streams::server(kj::Own<kj::AsyncIoStream> stream) {
  return impl_->server.wrapServer(kj::mv(stream));
}

kj::Promise<kj::Own<kj::AsyncIoStream>> Streams::client(kj::Own<kj::AsyncIoStream> stream) {
  return impl_->client.wrapClient(kj::mv(stream), kServerName);
}

namespace {

class PrefixedStream final : public ForwardingStream {
 public:
  PrefixedStream(kj::Own<kj::AsyncIoStream> inner, kj::Array<kj::byte> prefix)
      : ForwardingStream(kj::mv(inner)), prefix_(kj::mv(prefix)) {}

  kj::Promise<size_t> tryRead(void* buffer, size_t minBytes, size_t maxBytes) override {
    if (at_ >= prefix_.size()) return inner_->tryRead(buffer, minBytes, maxBytes);
    size_t n = std::min(maxBytes, prefix_.size() - at_);
    memcpy(buffer, prefix_.begin() + at_, n);
    at_ += n;
    if (n >= minBytes) return n;
    return inner_->tryRead(static_cast<kj::byte*>(buffer) + n, minBytes - n, maxBytes - n).then([n](size_t more) {
      return n + more;
    });
  }

 private:
  kj::Array<kj::byte> prefix_;
  size_t at_ = 0;
};

}  // namespace

kj::Own<kj::AsyncIoStream> prefixed(kj::Own<kj::AsyncIoStream> inner, kj::Array<kj::byte> prefix) {
  return kj::heap<PrefixedStream>(kj::mv(inner), kj::mv(prefix));
}

Result<int> relay(int fd, const std::string& token, bool server, std::chrono::milliseconds timeout) {
  auto r = std::make_unique<Relay>();
  r->net = fd;
  auto fail = [&](StatusCode code, const std::string& why) { return Status(code, "TLS: " + why); };
  Identity id = identity(token);
  r->ctx.reset(SSL_CTX_new(server ? TLS_server_method() : TLS_client_method()));
  if (!r->ctx) return fail(StatusCode::kInternal, sslError());
  SSL_CTX_set_min_proto_version(r->ctx.get(), TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(r->ctx.get(), "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384");
  BioPtr certBio(BIO_new_mem_buf(id.certPem.data(), static_cast<int>(id.certPem.size())));
  X509Ptr cert(PEM_read_bio_X509(certBio.get(), nullptr, nullptr, nullptr));
  if (!cert) return fail(StatusCode::kInternal, sslError());
  if (server) {
    BioPtr keyBio(BIO_new_mem_buf(id.keyPem.data(), static_cast<int>(id.keyPem.size())));
    PkeyPtr key(PEM_read_bio_PrivateKey(keyBio.get(), nullptr, nullptr, nullptr));
    if (!key || SSL_CTX_use_certificate(r->ctx.get(), cert.get()) != 1 ||
        SSL_CTX_use_PrivateKey(r->ctx.get(), key.get()) != 1) {
      return fail(StatusCode::kInternal, sslError());
    }
  } else {
    // Trust exactly the cluster certificate, and check the name in it.
    X509_STORE_add_cert(SSL_CTX_get_cert_store(r->ctx.get()), cert.get());
    SSL_CTX_set_verify(r->ctx.get(), SSL_VERIFY_PEER, nullptr);
  }
  r->ssl.reset(SSL_new(r->ctx.get()));
  if (!r->ssl) return fail(StatusCode::kInternal, sslError());
  if (!server) {
    SSL_set1_host(r->ssl.get(), kServerName);
    SSL_set_tlsext_host_name(r->ssl.get(), kServerName);
  }
  SSL_set_mode(r->ssl.get(), SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  SSL_set_fd(r->ssl.get(), fd);
  auto deadline = std::chrono::steady_clock::now() + timeout;
  sigset_t pipe, previous;
  sigemptyset(&pipe);
  sigaddset(&pipe, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe, &previous);
  struct RestoreMask {
    sigset_t pipe, previous;
    ~RestoreMask() {
      timespec zero{0, 0};
      while (sigtimedwait(&pipe, nullptr, &zero) > 0) {
      }  // a SIGPIPE this handshake raised
      pthread_sigmask(SIG_SETMASK, &previous, nullptr);
    }
  } restoreMask{pipe, previous};
  for (;;) {
    int rc = server ? SSL_accept(r->ssl.get()) : SSL_connect(r->ssl.get());
    if (rc == 1) break;
    int e = SSL_get_error(r->ssl.get(), rc);
    if (e != SSL_ERROR_WANT_READ && e != SSL_ERROR_WANT_WRITE) {
      long verify = SSL_get_verify_result(r->ssl.get());
      if (!server && verify != X509_V_OK) {
        return fail(StatusCode::kUnauthenticated,
                    fmt::format("the server's certificate is not this cluster's ({})", X509_verify_cert_error_string(verify)));
      }
      return fail(StatusCode::kUnavailable, fmt::format("handshake failed: {}", sslError()));
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return fail(StatusCode::kUnavailable, "no TLS handshake in time");
    pollfd p{fd, static_cast<short>(e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
  }
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    return fail(StatusCode::kInternal, fmt::format("socketpair: {}", strerror(errno)));
  }
  r->local = pair[0];
  for (int end : pair) {
    int bytes = 4 << 20;  // room for several chunks each way, as a TCP socket would have
    ::setsockopt(end, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
    ::setsockopt(end, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  }
  ::fcntl(pair[0], F_SETFL, ::fcntl(pair[0], F_GETFL) | O_NONBLOCK);
  static std::once_flag atExit;
  std::call_once(atExit, []() { std::atexit(drainRelaysAtExit); });
  relayState(r.get(), true);
  std::thread(pump, std::move(r)).detach();
  return pair[1];
}

}  // namespace troupe::tls
