#pragma once
// Buffers whose resize() does not write the new elements: sized to an upper bound (a payload of
// maxPayloadBytes(), a codec's workspace) or zero from the start (codec state), only the pages
// that are written become resident memory (docs/deploy.md "Sizing").

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace lightwire::kernels {

/// std::allocator whose value-less construct() default-initialises (leaves trivial types
/// unwritten) instead of value-initialising (zeroing).
template <typename T>
struct DefaultInitAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };
  DefaultInitAllocator() = default;
  template <typename U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    std::allocator_traits<std::allocator<T>>::construct(static_cast<std::allocator<T>&>(*this), p,
                                                        std::forward<Args>(args)...);
  }
};

/// An allocator of zeroed memory that is not written to zero it: calloc, whose large blocks are
/// fresh pages the kernel provides zeroed, so a reservation that is never written (PowerSGD's room
/// for any view's factor) never becomes resident. construct() without a value writes nothing.
template <typename T>
struct ZeroedAllocator {
  using value_type = T;
  ZeroedAllocator() = default;
  template <typename U>
  ZeroedAllocator(const ZeroedAllocator<U>&) noexcept {}
  T* allocate(size_t n) {
    if (n == 0) n = 1;
    void* p = std::calloc(n, sizeof(T));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) noexcept { std::free(p); }
  template <typename U>
  void construct(U* p) noexcept {
    static_assert(std::is_trivially_default_constructible_v<U>);
    (void)p;  // calloc'ed memory is already zero, the value of a value-initialised U
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <typename U>
  bool operator==(const ZeroedAllocator<U>&) const noexcept {
    return true;
  }
};

/// A payload buffer (sized to the codec's bound, then to what was written).
using PayloadBuffer = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;
/// A codec workspace. Contents past what was written are indeterminate.
using WorkspaceBuffer = std::vector<std::byte, DefaultInitAllocator<std::byte>>;
/// Codec state: zeros until written, resident only where written.
using StateBuffer = std::vector<float, ZeroedAllocator<float>>;

}  // namespace lightwire::kernels
