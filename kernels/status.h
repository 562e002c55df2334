#pragma once
// Status / Result<T>: the error values used at module boundaries. Bad input from outside is an
// error value with a message, never an abort or an exception on the data path.

#include <cassert>
#include <string>
#include <utility>
#include <variant>

namespace lightwire {

enum class StatusCode : int {
  kOk = 0,
  kInvalidArgument,  // a caller or config gave a bad value
  kDataLoss,         // a payload or file is malformed (truncated, inconsistent, hostile)
  kOutOfRange,       // a size or index exceeds what the target can hold
  kFailedPrecondition,
  kInternal,
  kUnavailable,
  kAborted,  // another rank gave up the step (a peer's ABORT): fail it too, and blame that rank
};

/// Outcome of an operation: ok, or a code with a human-readable message. Cheap when ok.
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok() { return {}; }
  bool isOk() const { return code_ == StatusCode::kOk; }
  explicit operator bool() const { return isOk(); }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalidArgument(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status dataLoss(std::string m) { return {StatusCode::kDataLoss, std::move(m)}; }
inline Status outOfRange(std::string m) { return {StatusCode::kOutOfRange, std::move(m)}; }
inline Status failedPrecondition(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status internalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

/// A value or the Status explaining why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT(google-explicit-constructor)
  Result(Status status) : v_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!std::get<Status>(v_).isOk());
  }

  bool isOk() const { return std::holds_alternative<T>(v_); }
  explicit operator bool() const { return isOk(); }
  const Status& status() const {
    static const Status kOkStatus;
    return isOk() ? kOkStatus : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace lightwire

#define LW_RETURN_IF_ERROR(expr)               \
  do {                                         \
    ::lightwire::Status lw_status_ = (expr);   \
    if (!lw_status_.isOk()) return lw_status_; \
  } while (0)
