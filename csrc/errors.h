// Error kinds crossing the C++/Python boundary; the binding maps each to a
// class in python/varcomm/errors.py.
#pragma once
#include <stdexcept>
#include <string>

namespace varcomm {

enum class ErrorKind : int { None = 0, Invalid, TooLarge, Mismatch, Timeout, PeerFailure, Closed };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& msg, int peer = -1, bool forced = false)
      : std::runtime_error(msg), kind(kind), peer(peer), forced(forced) {}
  ErrorKind kind;
  int peer;
  // What failed is a choice the user forced (an option set to on): set-up
  // raises it rather than routing around it as it does for auto choices.
  bool forced;
};

}  // namespace varcomm
