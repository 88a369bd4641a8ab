// Error kinds crossing the C++/Python boundary; the binding maps each to a
// class in python/varcomm/errors.py.
#pragma once
#include <stdexcept>
#include <string>

namespace varcomm {

enum class ErrorKind : int { None = 0, Invalid, TooLarge, Mismatch, Timeout, PeerFailure, Closed,
                             Refused /* a peer could not send to us and raised */ };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg, int peer = -1)
      : std::runtime_error(msg), kind(kind), peer(peer) {}
  ErrorKind kind;
  int peer;
};

}  // namespace varcomm
