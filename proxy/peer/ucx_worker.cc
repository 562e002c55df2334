#include "proxy/peer/ucx_worker.h"

#include <spdlog/fmt/fmt.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>

#include <cerrno>
#include <cstring>

namespace lightwire::proxy::peer {

Status openUcxWorker(const std::string& host, uint16_t port, const SockAddr& addr,
                     ucp_am_recv_callback_t on_am, ucp_listener_conn_callback_t on_conn, void* arg,
                     UcxWorker& w) {
  auto failed = [&](const char* what, ucs_status_t st) {
    return Status(
        StatusCode::kUnavailable,
        fmt::format("peer: cannot listen on {}:{} (ucx): {}: {}", host, port, what, ucsText(st)));
  };
  ucp_config_t* config = nullptr;
  if (ucs_status_t st = ucp_config_read(nullptr, nullptr, &config); st != UCS_OK) {
    return failed("ucp_config_read", st);
  }
  // A restarted sidecar must be able to listen on its port again while connections of its
  // previous life linger in TIME_WAIT (as SO_REUSEADDR does for the tcp transport).
  ucp_config_modify(config, "CM_REUSEADDR", "y");
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
  params.name = "lightwire";
  ucs_status_t st = ucp_init(&params, config, &w.context);
  ucp_config_release(config);
  if (st != UCS_OK) return failed("ucp_init", st);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // the progress thread owns the worker
  if (st = ucp_worker_create(w.context, &wp, &w.worker); st != UCS_OK) {
    return failed("ucp_worker_create", st);
  }
  if (st = ucp_worker_get_efd(w.worker, &w.worker_fd); st != UCS_OK) {
    return failed("ucp_worker_get_efd", st);
  }
  ucp_am_handler_param_t ap{};
  ap.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                  UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  ap.id = kAmId;
  ap.flags = UCP_AM_FLAG_WHOLE_MSG;
  ap.cb = on_am;
  ap.arg = arg;
  if (st = ucp_worker_set_am_recv_handler(w.worker, &ap); st != UCS_OK) {
    return failed("ucp_worker_set_am_recv_handler", st);
  }

  ucp_listener_params_t lp{};
  lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  lp.sockaddr.addr = addr.get();
  lp.sockaddr.addrlen = addr.length;
  lp.conn_handler.cb = on_conn;
  lp.conn_handler.arg = arg;
  if (st = ucp_listener_create(w.worker, &lp, &w.listener); st != UCS_OK) {
    return failed("ucp_listener_create", st);
  }
  ucp_listener_attr_t la{};
  la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  if (st = ucp_listener_query(w.listener, &la); st != UCS_OK) {
    return failed("ucp_listener_query", st);
  }
  w.listen_port = sockaddrPort(la.sockaddr);

  w.event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  w.epoll_fd = ::epoll_create1(EPOLL_CLOEXEC);
  if (w.event_fd < 0 || w.epoll_fd < 0) {
    return Status(StatusCode::kUnavailable,
                  fmt::format("peer: eventfd/epoll: {}", std::strerror(errno)));
  }
  for (int fd : {w.worker_fd, w.event_fd}) {
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (::epoll_ctl(w.epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0) {
      return Status(StatusCode::kUnavailable,
                    fmt::format("peer: epoll_ctl: {}", std::strerror(errno)));
    }
  }
  return Status::ok();
}

}  // namespace lightwire::proxy::peer
