// The job key's cryptography: SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104),
// written here so the core needs no crypto library. Used at set-up only (to
// authenticate the records ranks publish in the store, and to derive the
// per-pair tag every message header carries); never on the message path.
#pragma once
#include <cstdint>
#include <string>

namespace varcomm {

// 32 raw bytes.
std::string sha256(const std::string& data);
std::string hmac_sha256(const std::string& key, const std::string& msg);
// Equal strings, in time that does not depend on where they differ.
bool same_secret(const std::string& a, const std::string& b);
// `n` bytes from the kernel's CSPRNG (getrandom); throws when it has none.
std::string random_bytes(size_t n);
std::string to_hex(const std::string& bytes);

}  // namespace varcomm
