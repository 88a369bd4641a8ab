// The varcomm wire protocol, written once for every transport.
//
// Each rank owns one *region*: a control block, a row of credit words per peer,
// and per sending peer a ring of bound-sized slots. A sender writes a message
// (header + payload) into a free slot of the receiver's ring with a one-sided
// write, and the slot's `ready` word becomes the message's sequence number once
// header and payload are visible. The receiver frees a slot by writing the
// consumed sequence number into the sender's credit word for that slot, also
// one-sided. No message ever travels separately from its data.
#pragma once
#include <cstddef>
#include <cstdint>

namespace varcomm {

constexpr uint64_t kMagic = 0x316d6d6f63726176ULL;  // "varcomm1"
constexpr int kMaxDims = 8;
constexpr size_t kCtlBytes = 4096;     // region control block
constexpr size_t kSlotCtlBytes = 128;  // slot ready word, own cache lines
constexpr size_t kHeaderBytes = 128;
// Header and payload are contiguous so one remote write covers both.
constexpr size_t kHeaderOff = kSlotCtlBytes;
constexpr size_t kPayloadOff = kSlotCtlBytes + kHeaderBytes;

inline constexpr size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Collective tags (collectives.cpp, coll_tag) are >= kCollTagBase; user
// point-to-point tags stay below it.
constexpr int64_t kCollTagBase = int64_t(1) << 40;

// The header of one message: where a message's size, dtype and shape are written.
struct MsgHeader {
  uint64_t seq;     // 1-based per (sender, receiver) pair
  uint64_t nbytes;  // payload bytes
  int64_t tag;
  uint32_t dtype;   // DLPack (code << 16 | bits << 8 | lanes); see python/varcomm/dtypes.py
  uint32_t ndim;
  int64_t shape[kMaxDims];
  uint64_t flags;  // kDevicePayload | kDescriptor | the sender's array kind (kArrayShift)
  // The pair's tag (routes.cpp, pair_tag): derived from the job key, so a
  // write by anyone outside the job is recognised and discarded (engine.cpp,
  // progress_recvs). Checking it is one compare per arrival.
  uint64_t auth;
  // kRendezvous: where the data waits in the sender's address space (the
  // receiver copies it from there once, transport.h read_peer).
  uint64_t src;
};
// The payload is in the receiver's device slot.
constexpr uint64_t kDevicePayload = 1;
// A descriptor: nbytes, dtype and shape describe data that travels in later
// messages (bound-sized chunks, or the payload phase of a two-phase
// all-to-all), or that could not be sent at all; it carries no payload of its
// own, so nbytes may exceed the bound. One header type for every "size first"
// framing.
constexpr uint64_t kDescriptor = 2;
// A rendezvous head: nbytes, dtype and shape describe data that stays in the
// sender's memory (at `src`) until the receiver has a buffer for it. The
// receiver then either copies it from there itself (transport.h read_peer:
// one copy, shm with CMA) and frees the head's slot with its seq, or frees it
// with seq | kStreamCredit: "stream it", and the sender writes the data as
// kChunk messages through the ring. The send completes when the receiver has
// the data, so nbytes is not held to the bound (protocol below the bound is
// eager: header and payload in one slot).
constexpr uint64_t kRendezvous = 4;
// A piece of a rendezvous message's data, in order: `tag` is the head's seq
// (which message it belongs to); it is never matched by a receive.
constexpr uint64_t kChunk = 8;
// With kDescriptor: the sender refused its part of this collective before it
// started (a local argument error), so its receivers fail the call at once
// and stay in step with it (AllToAll::refuse).
constexpr uint64_t kRefusedCall = 16;
// With kRendezvous: the sender's copies into the receiver's slots are in a
// slow spell right now (Transport::slot_writes_slow), so a receiver that may
// read the sender's memory (CMA) should, even where it would otherwise have
// the data streamed through the slots. A hint: ignoring it is correct.
constexpr uint64_t kSlowSlots = 32;
// The sender closed its communicator: its last message to this rank, written
// once nothing it sent before is still moving (no payload; never matched).
// The receiver then fails what waits on that sender at once: otherwise a
// recv from a rank that closed waits until the closer's close() ends (up to
// 30 s on the store's host) or its own timeout (Engine::goodbye).
constexpr uint64_t kGoodbye = 64;
// A goodbye's tag: the sender's process exits after an uncaught exception.
constexpr int64_t kByeFailing = 1;
// With kDescriptor: the sender could not send the collective chunk it
// describes because it is over the sender's own Options::max_message (not
// the receiver's bound), so its receiver expects no payload and says which
// limit it was.
constexpr uint64_t kOverMaxMessage = 128;
// With a collective's chunk or descriptor (a bit above the array kind's): it
// belongs to the backward of a differentiable all-to-all (autograd). A
// receiver whose call is a forward (or the other way round: a rank ran no
// backward) takes it, drops it and fails the call naming the ranks out of
// step, where the two paired a gradient with a forward's rows unnoticed
// whenever their shapes agreed.
constexpr uint64_t kBackwardCall = uint64_t(1) << 16;
// Bits 32-55 of a collective's chunk or descriptor: a value every rank passes
// alike for that call (A2APlan::agree; 0: none), checked by each receiver;
// its top 4 bits say what kind of value it is (kAgreeKindShift), so two
// calls of different kinds are out of step, not a mismatch of values.
constexpr int kAgreeShift = 32;
constexpr uint64_t kAgreeMask = 0xFFFFFFull << kAgreeShift;
constexpr int kAgreeKindShift = 20;
// The credit value that asks a rendezvous sender to stream (see kRendezvous).
constexpr uint64_t kStreamCredit = 1ull << 63;
// The credit value that asks a rendezvous sender to write the data itself,
// in one piece, into the receiver's *landing area* (after the slot rings,
// Layout::landing_off) at a block the receiver allocated for it: the message
// lands where the receive's result lives, so it is copied once, by the
// sender, at memcpy speed (shm) or by one remote write (rdma). The write is
// an ordinary write_message at the block's offset, header (seq = the head's,
// flags kChunk) then data, and the block's first word becomes the head's seq
// once both are visible, exactly as for a slot. Bits 32-60: the block's
// offset in 4 KiB pages; bits 0-31: the head's seq, truncated (only the
// head's own answer is ever compared with it).
constexpr uint64_t kPushCredit = 1ull << 61;
inline uint64_t push_credit(uint64_t seq, size_t block_off) {
  return kPushCredit | (uint64_t(block_off >> 12) << 32) | (seq & 0xffffffffull);
}
inline bool is_push_credit(uint64_t c, uint64_t seq) {
  return (c >> 61) == 1 && uint32_t(c) == uint32_t(seq);
}
inline size_t push_block(uint64_t c) { return size_t((c >> 32) & 0x1fffffffull) << 12; }
// The credit value that asks the sender of a collective's chunk (a held
// rendezvous head, whose receiver claimed it: kRvClaimed) to copy the data
// itself to an offset of the receiver's region: the output the receiver
// placed in its landing area, at that source's rows. One memcpy by the
// sender, where a CMA read by the receiver is slower (AMD EPYC, 2 MiB chunks
// out of cache: 13 GB/s against 8 GB/s). No header goes with it (the output
// is contiguous); the word kRvPushOff of the head's slot says who copies,
// one compare-and-swap at a time, values seq * 4 + state:
//   pushing   the sender is copying;
//   pushed    it has (release: the data is visible);
//   revoked   the receiver stopped waiting for it (Engine::kPushGrace: the
//             sender is not progressing) and copies by CMA itself.
// Then the receiver answers the head with its seq as for any rendezvous.
// Bits 32-60: the offset in 64-byte units; bits 0-31: the head's seq, truncated.
constexpr uint64_t kRawCredit = 3ull << 61;
inline uint64_t raw_credit(uint64_t seq, size_t off) {
  return kRawCredit | (uint64_t(off >> 6) << 32) | (seq & 0xffffffffull);
}
inline bool is_raw_credit(uint64_t c, uint64_t seq) { return (c >> 61) == 3 && uint32_t(c) == uint32_t(seq); }
inline size_t raw_off(uint64_t c) { return size_t((c >> 32) & 0x1fffffffull) << 6; }
constexpr size_t kRawOffMax = size_t(0x1fffffffull) << 6;
// The credit value a receiver answers a head with when it claimed the data
// (kRvClaimed below) and could not copy it: the send fails (PeerFailure).
constexpr uint64_t kFailCredit = 1ull << 62;
// Where the receiver copies a rendezvous head's data itself (shm with CMA),
// sender and receiver agree on who owns the source through a word in the
// head's slot control block (the receiver's region, mapped by both), one
// atomic compare-and-swap at a time, values seq * 4 + state:
//   offered   the sender wrote the head; the data is at the header's `src`;
//   claimed   the receiver is copying it (the sender waits for its credit:
//             the seq, or seq | kFailCredit);
//   moved     the sender gave up waiting (a timeout): it copied the data into
//             memory of its own, at the word kRvMovedOff, and the user's
//             buffer is free; the receiver still gets the message from there;
//   withdrawn the sender closed: nothing is there to copy any more.
// Without it a receiver could copy a buffer its owner has been told is free
// (silently wrong data). Slot control block: ready word at 0, the device
// data flag at 64 (transport/nvlink), these two at 96 and 104, kRawCredit's at 112.
constexpr size_t kRvStateOff = 96;
constexpr size_t kRvMovedOff = 104;
constexpr size_t kRvPushOff = 112;  // kRawCredit's word
enum RvState : uint64_t { kRvOffered = 0, kRvClaimed = 1, kRvMoved = 2, kRvWithdrawn = 3 };
enum PushState : uint64_t { kPushing = 1, kPushed = 2, kPushRevoked = 3 };
inline uint64_t rv_word(uint64_t seq, RvState s) { return seq * 4 + s; }
inline uint64_t push_word(uint64_t seq, PushState s) { return seq * 4 + s; }
// Bits 8-15: the kind of array the sender passed (python/varcomm/arrays.py
// KINDS: 1 numpy, 2 torch, 3 cupy; 0 unknown), so a receiver may answer in
// kind (array="auto"). The core carries it and never acts on it.
constexpr int kArrayShift = 8;
constexpr uint64_t kArrayMask = 0xFFull << kArrayShift;
// Every flag a header of host memory may carry: a transport that checks what
// arrives (the fallback's) refuses any other bit. A new flag goes here too.
constexpr uint64_t kHostHeaderFlags = kDescriptor | kRendezvous | kChunk | kRefusedCall | kSlowSlots | kGoodbye |
                                      kOverMaxMessage | kBackwardCall | kAgreeMask | kArrayMask;
// A receive's out dtype word (DLPack, 24 bits) with this bit: the message
// must fill out exactly (torch.distributed.recv's contract), else it is
// refused and kept like one that does not fit (Engine::misfit).
constexpr uint32_t kOutExact = 1u << 31;
// Payload bytes a message occupies in its slot.
inline uint64_t payload_bytes(const MsgHeader& h) { return (h.flags & (kDescriptor | kRendezvous)) ? 0 : h.nbytes; }
static_assert(sizeof(MsgHeader) <= kHeaderBytes, "header must fit its slot area");
static_assert(kRvPushOff + 8 <= kSlotCtlBytes, "rendezvous words must fit the slot control block");

// The start of every region: what a peer that maps it checks it mapped
// (region.h, region_mismatch) before writing into it.
struct RegionCtl {
  uint64_t magic;
  int32_t rank;
  int32_t world;
  int32_t nslots;
  int32_t pid;
  uint64_t bound;
  uint64_t landing;  // bytes of the landing area (kPushCredit)
};

// Offsets inside one rank's region. A sender uses the *receiver's* layout, so
// ranks may pick different bounds and depths.
struct Layout {
  int world = 0;
  int nslots = 0;
  uint64_t bound = 0;
  uint64_t landing = 0;  // bytes of the landing area after the rings (kPushCredit); 0: none

  size_t slot_bytes() const { return kPayloadOff + align_up(bound, 256); }
  size_t credit_row() const { return align_up(size_t(nslots) * 8, 64); }
  size_t credit_off(int peer, int slot) const {
    return kCtlBytes + size_t(peer) * credit_row() + size_t(slot) * 8;
  }
  size_t rings_off() const { return align_up(kCtlBytes + size_t(world) * credit_row(), 4096); }
  size_t slot_off(int sender, int slot) const {
    return rings_off() + (size_t(sender) * nslots + slot) * slot_bytes();
  }
  size_t total() const { return slot_off(world, 0); }
  // The landing area: blocks of whole pages, each a ready word, a header and
  // then the data (the same offsets as a slot), handed out per message by the
  // receiver (engine.cpp, Landing).
  size_t landing_off() const { return align_up(total(), 4096); }
  size_t region_bytes() const { return landing ? landing_off() + landing : total(); }
};

}  // namespace varcomm
