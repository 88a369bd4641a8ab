/* fi_pingpong: raw libfabric fi_writedata ping-pong, the "limit" varcomm's rdma
 * transport is measured against.
 *
 * Each side registers one buffer; a ping is one fi_writedata of `size` bytes
 * into the peer's buffer with FI_REMOTE_CQ_DATA, and the peer answers as soon
 * as the remote completion shows up in its CQ. Output, one JSON object per size:
 *   {"provider":"tcp;ofi_rxm","size":8,"iters":2000,"lat_us":35.1,"gbps":0.0002}
 * lat_us is half the round trip; gbps is size / lat_us in 1e9 bytes per second.
 *
 *   fi_pingpong [-p prov] [-i domain] [-s size]... [-n iters]   fork both sides on this host
 *   fi_pingpong -S port [...]                                   server, waits for a client
 *   fi_pingpong -C host:port [...]                              client
 *   -R: each ping is a rendezvous, as varcomm's over eager_max into a landing
 *       area: an 8-byte head, the peer's 8-byte answer, then the data (three
 *       writes); the limit for that protocol on the provider
 * The out-of-band TCP socket only exchanges addresses and keys.
 *
 * Build: cc -O2 -o fi_pingpong fi_pingpong.c $(pkg-config --cflags --libs libfabric)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(call)                                                                   \
  do {                                                                                \
    long _r = (long)(call);                                                           \
    if (_r) {                                                                         \
      fprintf(stderr, "fi_pingpong: %s: %s (%ld)\n", #call, fi_strerror((int)-_r), _r); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

struct blob { /* what one side tells the other */
  uint64_t key, addr, namelen;
  char name[256];
};

static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_ep *ep;
static struct fid_cq *cq;
static struct fid_av *av;
static struct fid_mr *mr;
static struct fi_info *info;
static char *buf;
static void *desc;
static size_t maxsize;
static fi_addr_t peer;
static uint64_t peer_key, peer_addr;
static long remote_seen, posted, tx_done;
static int rendezvous; /* -R */
static volatile sig_atomic_t stopping; /* SIGTERM seen (on_term) */

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static void poll_cq(void) {
  if (stopping) exit(1);
  struct fi_cq_data_entry e[16];
  ssize_t n = fi_cq_read(cq, e, 16);
  if (n == -FI_EAGAIN) return;
  if (n == -FI_EAVAIL) {
    struct fi_cq_err_entry err = {0};
    fi_cq_readerr(cq, &err, 0);
    fprintf(stderr, "fi_pingpong: cq error: %s\n",
            fi_cq_strerror(cq, err.prov_errno, err.err_data, NULL, 0));
    exit(1);
  }
  if (n < 0) CHECK(n);
  for (ssize_t i = 0; i < n; i++) {
    if (e[i].flags & FI_REMOTE_CQ_DATA) remote_seen++;
    else tx_done++;
  }
}

/* Close what setup() opened, at every exit: libfabric's shm provider backs
 * each endpoint with a /dev/shm file that only fi_close(ep) removes (left
 * behind, every run of the baseline leaked 16 MiB there). */
static void teardown(void) {
  if (ep) fi_close(&ep->fid), ep = NULL;
  if (mr) fi_close(&mr->fid), mr = NULL;
  if (av) fi_close(&av->fid), av = NULL;
  if (cq) fi_close(&cq->fid), cq = NULL;
  if (domain) fi_close(&domain->fid), domain = NULL;
  if (fabric) fi_close(&fabric->fid), fabric = NULL;
}

/* SIGTERM (the bench's timeout, the client's death) exits through teardown,
 * from the polling loop: exit() in the handler deadlocked when the signal
 * landed inside libfabric, which holds locks its own exit path takes. Without
 * SA_RESTART, a blocking read() returns (EINTR) and its loop ends too. */
static void on_term(int sig) {
  (void)sig;
  stopping = 1;
}

static void setup(const char *prov, const char *dom) {
  atexit(teardown);
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_term; /* (no SA_RESTART) */
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, NULL);
  struct fi_info *hints = fi_allocinfo();
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_RMA | FI_WRITE | FI_REMOTE_WRITE;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->fabric_attr->prov_name = strdup(prov);
  if (dom && *dom) hints->domain_attr->name = strdup(dom);
  CHECK(fi_getinfo(FI_VERSION(1, 10), NULL, NULL, 0, hints, &info));
  fi_freeinfo(hints);
  /* Prefer IPv4 on a real interface (loopback-only fabrics do not reach other hosts). */
  for (struct fi_info *i = info; i; i = i->next)
    if (i->addr_format == FI_SOCKADDR_IN && !(dom && *dom) &&
        strcmp(i->domain_attr->name, "lo") != 0) {
      info = fi_dupinfo(i);
      break;
    }
  CHECK(fi_fabric(info->fabric_attr, &fabric, NULL));
  CHECK(fi_domain(fabric, info, &domain, NULL));
  struct fi_cq_attr cqa = {.format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE, .size = 1024};
  CHECK(fi_cq_open(domain, &cqa, &cq, NULL));
  struct fi_av_attr ava = {.type = FI_AV_TABLE};
  CHECK(fi_av_open(domain, &ava, &av, NULL));
  CHECK(fi_endpoint(domain, info, &ep, NULL));
  CHECK(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
  CHECK(fi_ep_bind(ep, &av->fid, 0));
  CHECK(fi_enable(ep));

  /* [0, maxsize) receives, [maxsize, 2*maxsize) is the send source. */
  buf = mmap(NULL, 2 * maxsize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  memset(buf, 0xab, 2 * maxsize);
  CHECK(fi_mr_reg(domain, buf, 2 * maxsize, FI_WRITE | FI_REMOTE_WRITE, 0, 1, 0, &mr, NULL));
  if (info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
    CHECK(fi_mr_bind(mr, &ep->fid, 0));
    CHECK(fi_mr_enable(mr));
  }
  desc = fi_mr_desc(mr);
}

static void exchange(int fd) {
  struct blob me = {0}, them;
  me.namelen = sizeof me.name;
  CHECK(fi_getname(&ep->fid, me.name, &me.namelen));
  me.key = fi_mr_key(mr);
  me.addr = (info->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? (uint64_t)(uintptr_t)buf : 0;
  if (write(fd, &me, sizeof me) != sizeof me) exit(1);
  size_t got = 0;
  while (got < sizeof them) {
    ssize_t r = read(fd, (char *)&them + got, sizeof them - got);
    if (r <= 0) { fprintf(stderr, "fi_pingpong: peer closed\n"); exit(1); }
    got += r;
  }
  if (fi_av_insert(av, them.name, 1, &peer, 0, NULL) != 1) exit(1);
  peer_key = them.key;
  peer_addr = them.addr;
}

static void post(size_t size, uint64_t imm) {
  static struct fi_context2 ctx[4096];
  static unsigned next;
  for (;;) {
    ssize_t r = fi_writedata(ep, buf + maxsize, size, desc, imm, peer, peer_addr, peer_key,
                             &ctx[next++ % 4096]);
    if (r == 0) { posted++; return; }
    if (r != -FI_EAGAIN) CHECK(r);
    poll_cq();
  }
}

static void wait_remote(long target) {
  double give_up = now_us() + 60e6;  /* a lost message must not hang a benchmark run */
  while (remote_seen < target) {
    poll_cq();
    if (now_us() > give_up) {
      fprintf(stderr, "fi_pingpong: no message from the peer for 60 s\n");
      exit(1);
    }
  }
}

/* Run one size; the client (initiator) times it. Returns half round trip in us. */
static double run(int client, size_t size, int iters) {
  int warm = iters / 10 + 2;
  double t0 = 0;
  for (int i = 0; i < warm + iters; i++) {
    if (i == warm) t0 = now_us();
    if (rendezvous) { /* head, answer, data; then the same back */
      if (client) {
        post(8, i), wait_remote(remote_seen + 1), post(size, i);
        wait_remote(remote_seen + 1), post(8, i), wait_remote(remote_seen + 1);
      } else {
        wait_remote(remote_seen + 1), post(8, i), wait_remote(remote_seen + 1);
        post(8, i), wait_remote(remote_seen + 1), post(size, i);
      }
    } else if (client) {
      post(size, i);
      wait_remote(remote_seen + 1);
    } else {
      wait_remote(remote_seen + 1);
      post(size, i);
    }
  }
  double half = (now_us() - t0) / iters / 2;
  /* With manual progress (tcp) a posted write only moves while we poll: finish
   * our last one before blocking on the out-of-band socket. */
  while (tx_done < posted) poll_cq();
  return half;
}

/* About 256 MiB per size, 5 .. 2000 round trips. */
static int auto_iters(size_t size) {
  double n = 256.0 * (1 << 20) / size;
  return n > 2000 ? 2000 : n < 5 ? 5 : (int)n;
}

static int oob_listen(int port) {
  int s = socket(AF_INET, SOCK_STREAM, 0), one = 1;
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
  if (bind(s, (struct sockaddr *)&a, sizeof a) || listen(s, 1)) { perror("bind"); exit(1); }
  int c = accept(s, NULL, NULL);
  close(s);
  return c;
}

static int oob_connect(const char *hostport) {
  char host[256];
  snprintf(host, sizeof host, "%s", hostport);
  char *colon = strrchr(host, ':');
  if (!colon) { fprintf(stderr, "fi_pingpong: -C host:port\n"); exit(2); }
  *colon = 0;
  struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
  if (getaddrinfo(host, colon + 1, &hints, &res)) { fprintf(stderr, "bad host\n"); exit(1); }
  int s = socket(AF_INET, SOCK_STREAM, 0);
  for (int tries = 0; connect(s, res->ai_addr, res->ai_addrlen); tries++) {
    if (tries > 100) { perror("connect"); exit(1); }
    usleep(100000);
  }
  freeaddrinfo(res);
  return s;
}

int main(int argc, char **argv) {
  const char *prov = "tcp;ofi_rxm", *dom = NULL, *client_to = NULL;
  int server_port = -1, fixed_iters = 0, opt;
  size_t sizes[64];
  int nsizes = 0;
  while ((opt = getopt(argc, argv, "p:i:s:n:S:C:Rh")) != -1) {
    switch (opt) {
      case 'p': prov = optarg; break;
      case 'i': dom = optarg; break;
      case 's': if (nsizes < 64) sizes[nsizes++] = strtoull(optarg, NULL, 0); break;
      case 'n': fixed_iters = atoi(optarg); break;
      case 'S': server_port = atoi(optarg); break;
      case 'C': client_to = optarg; break;
      case 'R': rendezvous = 1; break;
      default:
        fprintf(stderr, "usage: %s [-p provider] [-i domain] [-s bytes]... [-n iters] "
                        "[-S port | -C host:port] [-R]\n", argv[0]);
        return 2;
    }
  }
  if (!nsizes) {
    size_t d[] = {8, 65536, 1 << 20, 4 << 20, 16 << 20, 64 << 20};
    for (unsigned i = 0; i < sizeof d / sizeof *d; i++) sizes[nsizes++] = d[i];
  }
  maxsize = 4096;
  for (int i = 0; i < nsizes; i++) if (sizes[i] > maxsize) maxsize = sizes[i];

  int fd, client;
  if (server_port >= 0) { fd = oob_listen(server_port); client = 0; }
  else if (client_to) { fd = oob_connect(client_to); client = 1; }
  else {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) { perror("socketpair"); return 1; }
    pid_t pid = fork();
    client = pid != 0;
    if (!client) prctl(PR_SET_PDEATHSIG, SIGTERM); /* never outlive the client (on_term cleans up) */
    fd = sv[client ? 0 : 1];
    close(sv[client ? 1 : 0]);
    if (client) {
      setup(prov, dom);
      exchange(fd);
      for (int i = 0; i < nsizes; i++) {
        int iters = fixed_iters ? fixed_iters : auto_iters(sizes[i]);
        if (write(fd, &iters, sizeof iters) != sizeof iters) return 1;
        double lat = run(1, sizes[i], iters);
        printf("{\"provider\":\"%s\",\"size\":%zu,\"iters\":%d,\"lat_us\":%.2f,\"gbps\":%.4f}\n",
               info->fabric_attr->prov_name, sizes[i], iters, lat, sizes[i] / lat / 1e3);
        fflush(stdout);
      }
      int stop = 0;
      if (write(fd, &stop, sizeof stop) < 0) return 1;
      int st;
      waitpid(pid, &st, 0);
      return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
  }
  setup(prov, dom);
  exchange(fd);
  if (client) { /* explicit client role: same loop as the forked client, server follows */
    for (int i = 0; i < nsizes; i++) {
      int iters = fixed_iters ? fixed_iters : auto_iters(sizes[i]);
      uint64_t msg[2] = {(uint64_t)iters, sizes[i]};
      if (write(fd, msg, sizeof msg) != sizeof msg) return 1;
      double lat = run(1, sizes[i], iters);
      printf("{\"provider\":\"%s\",\"size\":%zu,\"iters\":%d,\"lat_us\":%.2f,\"gbps\":%.4f}\n",
             info->fabric_attr->prov_name, sizes[i], iters, lat, sizes[i] / lat / 1e3);
      fflush(stdout);
    }
    uint64_t stop[2] = {0, 0};
    if (write(fd, stop, sizeof stop) < 0) return 1;
    return 0;
  }
  /* Server: the client says which size comes next (forked: same size table). */
  for (int i = 0;; i++) {
    size_t size;
    int iters;
    if (server_port >= 0) {
      uint64_t msg[2];
      if (read(fd, msg, sizeof msg) != sizeof msg || !msg[0]) break;
      iters = (int)msg[0];
      size = msg[1];
      if (size > maxsize) { fprintf(stderr, "fi_pingpong: server needs -s %zu\n", size); return 1; }
    } else {
      if (read(fd, &iters, sizeof iters) != sizeof iters || !iters) break;
      size = sizes[i];
    }
    run(0, size, iters);
  }
  return 0;
}
