#pragma once
// The UCX resources of the `ucx` transport (proxy/peer/ucx_transport.h): context, worker,
// listener, and the descriptors its progress thread sleeps on.

#include <ucp/api/ucp.h>

#include <cstdint>
#include <string>

#include "kernels/status.h"
#include "proxy/peer/sockaddr.h"

namespace lightwire::proxy::peer {

inline constexpr unsigned kAmId = 1;  // every lightwire frame is an active message with this id

inline std::string ucsText(ucs_status_t s) { return ucs_status_string(s); }

/// The UCX handles of one transport. Plain handles: whoever fills them (openUcxWorker) releases
/// them; not thread-safe (the worker belongs to one thread at a time).
struct UcxWorker {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  ucp_listener_h listener = nullptr;
  uint16_t listen_port = 0;
  int worker_fd = -1;
  int event_fd = -1;  // other threads wake the progress thread with it
  int epoll_fd = -1;
};

/// Creates the context and a single-threaded worker with wake-ups, sets `on_am` as the handler
/// of kAmId, listens on `addr` (`host`:`port` for messages) with `on_conn` for connection
/// requests, and makes the eventfd and the epoll set of the worker's fd and it. On an error what
/// was made so far is left in `w` for its owner to release.
Status openUcxWorker(const std::string& host, uint16_t port, const SockAddr& addr,
                     ucp_am_recv_callback_t on_am, ucp_listener_conn_callback_t on_conn, void* arg,
                     UcxWorker& w);

}  // namespace lightwire::proxy::peer
