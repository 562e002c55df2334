#pragma once
// Codec registry: codecs register a factory under their name at static-initialisation time
// (LW_REGISTER_CODEC); createCodec() builds one from a CodecConfig and, where
// docs/codecs.md "The codec interface" says so, wraps it in the error-feedback decorator.
// Registering a name twice is a programming error.

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/codec.h"

namespace lightwire::kernels {

using CodecFactory = std::function<Result<std::unique_ptr<Codec>>(const CodecConfig&)>;

/// Adds a factory under traits.name, with the codec's traits; fails when the name is already
/// taken.
Status registerCodec(const CodecTraits& traits, CodecFactory factory);

/// The traits of the codec registered as `name` (nullopt: none is), without building one: what
/// callers need to know of a codec before its configuration is complete.
std::optional<CodecTraits> findCodecTraits(std::string_view name);

/// Names of every registered codec, sorted.
std::vector<std::string> codecNames();

/// Builds the codec `config.name` (validating its parameters), wrapped in error feedback when
/// config.error_feedback (or, unset, the codec's default) asks for it. A codec with memory of its
/// own (dgc, powersgd) refuses error_feedback = true.
Result<std::unique_ptr<Codec>> createCodec(const CodecConfig& config);

/// Every field of a codec configuration as one string: equal strings, equal settings (owners of
/// per-tensor codecs recreate them when it changes).
std::string configKey(const CodecConfig& config);

/// The `none` codec, built once (decodes the plain fp32 sums of dense exchanges).
const Codec& noneCodec();

/// Wraps `inner` (a codec without memory of its own) in residual error feedback.
std::unique_ptr<Codec> makeErrorFeedback(std::unique_ptr<Codec> inner);

namespace detail {
struct CodecRegistrar {
  CodecRegistrar(const CodecTraits& traits, CodecFactory factory);
};
}  // namespace detail

}  // namespace lightwire::kernels

/// Registers `factory` under `traits` (a CodecTraits whose name is the codec's name).
#define LW_REGISTER_CODEC(ident, traits, factory)                                              \
  static const ::lightwire::kernels::detail::CodecRegistrar lw_codec_registrar_##ident(traits, \
                                                                                       factory)
