// Reproduces the "slow mode" of bench/results/issue11-2026-12-05-s8.md without varcomm: two processes
// each write 1 MiB into the other's half of a shared mapping (as a sender fills a slot) and copy their
// own half out (as a receiver drains one). Build: cc -O2 -mavx2 shm-cross-write.c; run: ./a.out MODE,
// MODE 0 memcpy, 1 AVX loop, 2 non-temporal stores, 3 rep movsb. Prints us per 1 MiB write and read.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/wait.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void cp_avx(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=128){__m256i a=_mm256_loadu_si256((void*)(s+i)),b=_mm256_loadu_si256((void*)(s+i+32)),c=_mm256_loadu_si256((void*)(s+i+64)),e=_mm256_loadu_si256((void*)(s+i+96));_mm256_storeu_si256((void*)(d+i),a);_mm256_storeu_si256((void*)(d+i+32),b);_mm256_storeu_si256((void*)(d+i+64),c);_mm256_storeu_si256((void*)(d+i+96),e);}}
static void cp_nt(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=128){__m256i a=_mm256_loadu_si256((void*)(s+i)),b=_mm256_loadu_si256((void*)(s+i+32)),c=_mm256_loadu_si256((void*)(s+i+64)),e=_mm256_loadu_si256((void*)(s+i+96));_mm256_stream_si256((void*)(d+i),a);_mm256_stream_si256((void*)(d+i+32),b);_mm256_stream_si256((void*)(d+i+64),c);_mm256_stream_si256((void*)(d+i+96),e);}_mm_sfence();}
static void cp_movsb(char*d,const char*s,size_t n){asm volatile("rep movsb":"+D"(d),"+S"(s),"+c"(n)::"memory");}
int main(int argc,char**argv){
  size_t n=1<<20; size_t stride=16<<20; int how=atoi(argv[1]);
  char*b=mmap(0,2*8*stride,PROT_READ|PROT_WRITE,MAP_SHARED|MAP_ANONYMOUS,-1,0);
  memset(b,2,2*8*stride);
  int me = fork()==0;
  char*a=aligned_alloc(4096,n),*o=aligned_alloc(4096,n);memset(a,1,n);memset(o,1,n);
  char*mine=b+me*8*stride, *peer=b+(1-me)*8*stride;
  double tw=0,tr=0; int N=2000;
  for(int r=0;r<N;r++){int k=r%8;double t=now();
    char*d=peer+k*stride+128;
    if(how==0)memcpy(d,a,n);else if(how==1)cp_avx(d,a,n);else if(how==2)cp_nt(d,a,n);else cp_movsb(d,a,n);
    tw+=now()-t;t=now();memcpy(o,mine+((k+4)%8)*stride+128,n);tr+=now()-t;}
  printf("p%d write %.1f us read %.1f us\n",me,tw/N*1e6,tr/N*1e6);
  if(!me) wait(0);
}
